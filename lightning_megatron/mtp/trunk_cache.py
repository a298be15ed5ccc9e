"""Train later epochs of MTP-only training from a cache of the frozen trunk's output.

In MTP-only training the trunk (embedding, decoder layers, final norm, main head) is frozen, so on a sample it has
seen before it computes the same thing again. What the MTP block reads from it is small: `GPTModel._postprocess`
hands `MultiTokenPredictionBlock` the decoder's output hidden states (after the final layernorm) and, besides, only
what comes with the microbatch (input ids it rolls and embeds through the shared frozen embedding, position ids,
the attention mask, the packed-sequence parameters) and the rotary embedding, which is a function of the sequence
length. So the first time a sample is seen (the first epoch, or any step whose sample is new) it is trained as
always and the last pipeline stage writes, per sample (a row of the microbatch: a padded sequence or a packed
row), the decoder's output hidden states. When every row of a microbatch is cached, its rows are read back and
the step runs `GPTModel._preprocess` (rotary only: the cached states stand in for the embedding's output) and
`_postprocess` (the MTP block and Megatron-Core's own `process_mtp_loss`, unchanged) on it: the decoder layers do
not run, the main head runs on the cached states only on the steps that log `lm_loss` (`mtp.skip_main_head`'s
chunked main loss, on demand, as in an uncached MTP-only step), and earlier pipeline stages run nothing (they hand
the schedule a zero placeholder of the shape it sends; the last stage ties the one it receives to its output with
a zero gradient, so the schedule's backward sends and receives what it expects). The MTP loss, its gradients and
the logged `lm_loss` are those of the uncached step: on CPU fp32 bit for bit.

Keys: xxh3-128 of a row's tensors as the data loader made them (input ids, labels, positions, the packing layout,
tree structure; not the loss mask, which the per-token loss does not read), so a shuffled epoch that pairs samples
into other microbatches, a resumed run or another data-parallel rank finds a sample wherever it was written. Per
step the ranks agree (one all-reduce over a gloo group; the keys cost one host copy of the step's token ids) which
microbatches every last-stage rank holds whole; one missing anywhere is computed by all, its rows written where
missing.

Tensor parallelism: under sequence parallelism each TP rank writes and reads its own sequence slice (`tp<r>`);
without it the hidden states are the same on every TP rank, so TP rank 0 writes one copy (`tp-all`) that every TP
rank reads. Context parallelism: each CP rank caches its own chunks (`cp<r>`). Data parallelism: every rank writes
the samples it computes; all read from the same folder (ranks on nodes that do not share it just hit less).

On disk (`trunk_cache_dir`)::

    manifest.json                 written first, by global rank 0: format, the frozen weights' checksum (xxh3 of
                                  MTPOnlyCallback's exact per-tensor checksums over all model-parallel shards), the
                                  training data's hash, the layout (TP, SP, PP, CP, hidden, dtype), bytes/token
    cp0-tp-all/                   one folder per CP rank and TP part
        3f/3f9c...e1.safetensors  one sample (row): `hidden` [s, 1, h] (the model's dtype)

Each shard is written under a hidden temporary name and renamed into place (`atomic.write_file_atomically`), so it
is either complete or absent: a full disk or a killed run leaves nothing a later run reads. The manifest comes
first (it says what the shards were made from, so a cache half filled by a preempted run is still used); a run
whose frozen weights or data hash differ from it is refused, naming both. A write that fails (full disk) stops
the run on every rank at the next step with the reason; the shards already written stay valid.

Reads are prefetched: when a step starts, a reader thread loads every cached microbatch of the step and copies it
to the device on a side stream while the step computes; writes go to a writer thread (bounded queue).
"""

from __future__ import annotations

import json
import os
import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from lightning_megatron.atomic import write_file_atomically, write_text_atomically
from lightning_megatron.distributed import cpu_group
from lightning_megatron.hf_io import TensorSpec, safetensors_layout
from lightning_megatron.microbatch import Microbatch, model_inputs
from lightning_megatron.mtp.skip_main_head import ZeroGradientTie, main_loss_processor
from lightning_megatron.staged_write import write_host_tensors

FORMAT_VERSION = 2
WRITE_QUEUE_ROWS = 16
_HIT, _MISS, _FAILED = 1, 0, -1


class TrunkCacheMismatch(ValueError):
    """The cache folder was written for other frozen weights, other data or another layout."""


class TrunkCacheWriteError(OSError):
    """A shard could not be written (e.g. the disk is full); nothing half-written was left."""


def row_keys(microbatch: Microbatch) -> list[str]:
    """One key per row of a microbatch: xxh3-128 of everything the trunk's output and the per-token main loss of
    that row depend on (its tokens, labels, positions, tree structure; the packing layout of a packed row). Rows,
    not microbatches: a shuffled epoch pairs the samples into other microbatches."""
    import xxhash

    rows = microbatch["input_ids"].shape[0]
    digests = [xxhash.xxh3_128() for _ in range(rows)]
    for name in sorted(microbatch):
        if name in _NOT_KEYED:
            continue
        value = microbatch[name]
        per_row = isinstance(value, torch.Tensor) and value.dim() == 2  # [b, s]; packing boundaries are the row's
        host = value.detach().cpu().contiguous() if isinstance(value, torch.Tensor) else None
        for row, digest in enumerate(digests):
            digest.update(name.encode() + b"\0")
            if host is None:
                digest.update(repr(value).encode())
                continue
            part = host[row] if per_row else host
            digest.update(f"{part.dtype}{tuple(part.shape)}".encode())
            digest.update(part.contiguous().view(torch.uint8).numpy().tobytes() if part.numel() else b"")
    return [digest.hexdigest() for digest in digests]


_NOT_KEYED = ("loss_mask", "indices")  # the per-token loss is unmasked; an index says where, not what


def _on_host(microbatches: list[Microbatch]) -> list[Microbatch]:
    """The keyed tensors of a step's microbatches on the host, after one wait for the device: a blocking copy per
    tensor (what `row_keys` would do) waited a dozen times per step."""
    copies = [{name: value.to("cpu", non_blocking=True) if isinstance(value, torch.Tensor) else value
               for name, value in microbatch.items() if name not in _NOT_KEYED} for microbatch in microbatches]
    if any(isinstance(value, torch.Tensor) and value.is_cuda for microbatch in microbatches
           for value in microbatch.values()):
        torch.cuda.current_stream().synchronize()
    return copies


def frozen_weights_hash(frozen_checksums: dict[str, tuple[int, int]]) -> str:
    """One hash of every rank's exact frozen-tensor checksums, by model-parallel coordinate (so the number of
    data-parallel replicas does not change it). Collective over the world."""
    import xxhash
    from megatron.core import parallel_state

    coordinate = (parallel_state.get_pipeline_model_parallel_rank(), parallel_state.get_tensor_model_parallel_rank(),
                  parallel_state.get_expert_model_parallel_rank())
    local = xxhash.xxh3_128(json.dumps(sorted(frozen_checksums.items())).encode()).hexdigest()
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, (coordinate, local), group=cpu_group())
    shards = sorted({(tuple(coordinate), shard) for coordinate, shard in gathered})
    return xxhash.xxh3_128(json.dumps(shards).encode()).hexdigest()


def training_data_hash(dataloader: Any) -> str:
    """The training set's hash: the tokenized-data cache key where the dataset rests on one (`SFTDataModule`, with
    its packing plan's shape), else xxh3-128 of every sample in index order (one pass over the dataset)."""
    import xxhash

    dataset = getattr(getattr(dataloader, "dataloader", dataloader), "dataset", None)
    if dataset is None:
        raise ValueError("trunk_cache_dir: the training dataloader has no dataset to hash")
    key = getattr(getattr(dataset, "examples", None), "key", None)
    if isinstance(key, str):
        parts = [type(dataset).__name__, key, getattr(dataset, "seq_length", None), len(dataset)]
        return xxhash.xxh3_128(json.dumps(parts).encode()).hexdigest()
    digest = xxhash.xxh3_128()
    for index in range(len(dataset)):
        item = dataset[index]
        item = item if isinstance(item, dict) else {"input_ids": item}
        digest.update("".join(row_keys({name: value[None] if isinstance(value, torch.Tensor) else value
                                        for name, value in item.items()})).encode())
    return digest.hexdigest()


class TrunkCache:
    """The cache of one fit (module docstring). `frozen_weights` and `data` are the hashes the manifest records;
    `chunks` the unwrapped model chunks of this rank; `config` their TransformerConfig."""

    def __init__(self, folder: str | Path, *, frozen_weights: str, data: str, chunks: list[torch.nn.Module],
                 config: Any) -> None:
        from megatron.core import parallel_state

        self.folder = Path(folder)
        self.config = config
        tp_rank = parallel_state.get_tensor_model_parallel_rank()
        self.sequence_parallel = bool(config.sequence_parallel)
        self.tp_size = parallel_state.get_tensor_model_parallel_world_size()
        part = f"tp{tp_rank}" if self.sequence_parallel else "tp-all"
        self.shards = self.folder / f"cp{parallel_state.get_context_parallel_rank()}-{part}"
        self.last_stage = parallel_state.is_pipeline_last_stage(ignore_virtual=True)
        self.writes = self.last_stage and (self.sequence_parallel or tp_rank == 0)
        self.dtype = config.pipeline_dtype or config.params_dtype
        self._open_manifest(frozen_weights, data)
        self.reads = self.writes_done = 0
        self._plan: list[tuple[list[str], bool]] = []
        self._pending: set[str] = set()  # queued for the writer, not yet on disk
        self._loaded: list[Future | None] = []
        self._cursor: dict[int, int] = {}
        self._captured: torch.Tensor | None = None
        self._capturing = False
        self._hooks = [chunk.decoder.register_forward_hook(self._capture) for chunk in chunks
                       if getattr(chunk, "post_process", False) and getattr(chunk, "mtp_process", False)]
        self._reader = ThreadPoolExecutor(max_workers=1, thread_name_prefix="trunk-cache-read")
        cuda = torch.cuda.is_available()
        self._side_stream, self._write_stream = (torch.cuda.Stream(), torch.cuda.Stream()) if cuda else (None, None)
        self._write_queue: queue.Queue = queue.Queue(maxsize=WRITE_QUEUE_ROWS)
        self._write_error: BaseException | None = None
        self._writer = threading.Thread(target=self._write_loop, name="trunk-cache-write", daemon=True)
        self._writer.start()

    # ------------------------------------------------------------------ manifest

    def bytes_per_token(self) -> int:
        """Disk bytes per training token over all ranks: its hidden state (under sequence parallelism each TP rank
        writes its own slice of the sequence, so still one hidden state a token)."""
        return self.config.hidden_size * self.dtype.itemsize

    def _open_manifest(self, frozen_weights: str, data: str) -> None:
        from megatron.core import parallel_state

        layout = {"tensor_parallel": self.tp_size, "sequence_parallel": self.sequence_parallel,
                  "pipeline_parallel": parallel_state.get_pipeline_model_parallel_world_size(),
                  "context_parallel": parallel_state.get_context_parallel_world_size(),
                  "hidden_size": self.config.hidden_size, "dtype": str(self.dtype)}
        wanted = {"format": FORMAT_VERSION, "frozen_weights": frozen_weights, "data": data, "layout": layout,
                  "bytes_per_token": self.bytes_per_token()}
        path = self.folder / "manifest.json"
        if dist.get_rank() == 0 and not path.exists():
            print(f"trunk cache {self.folder}: {wanted['bytes_per_token']} bytes per token (hidden states "
                  f"{self.config.hidden_size} x {self.dtype}), "
                  f"{wanted['bytes_per_token'] * 2**20 / 2**30:.2f} GiB per million tokens", flush=True)
            write_text_atomically(path, json.dumps(wanted, indent=2) + "\n")
        dist.barrier(group=cpu_group())
        found = json.loads(path.read_text())
        if found.get("format") != FORMAT_VERSION or found.get("layout") != layout:
            raise TrunkCacheMismatch(f"trunk_cache_dir: {self.folder} was written with format "
                                     f"{found.get('format')} and layout {found.get('layout')}; this run has format "
                                     f"{FORMAT_VERSION} and layout {layout}; use another folder")
        if (found["frozen_weights"], found["data"]) != (frozen_weights, data):
            changed = [what for what, old, new in (("frozen weights", found["frozen_weights"], frozen_weights),
                                                   ("data", found["data"], data)) if old != new]
            raise TrunkCacheMismatch(
                f"trunk_cache_dir: {self.folder} was written for frozen weights checksum {found['frozen_weights']} "
                f"and data hash {found['data']}; this run has frozen weights checksum {frozen_weights} and data "
                f"hash {data} ({' and '.join(changed)} changed); delete the folder or set another trunk_cache_dir")

    # ------------------------------------------------------------------ one step

    def plan_step(self, microbatches: list[Microbatch]) -> None:
        """Agree with every rank which microbatches of this step are read, start loading those; raise on every rank
        when a write failed anywhere."""
        keys = [row_keys(microbatch) for microbatch in _on_host(microbatches)]
        if self._pending.intersection(key for rows in keys for key in rows):
            self._write_queue.join()  # a sample seen a step or two ago: let its shard land first
        local = [_HIT if not self.last_stage or all(self._shard(key).exists() for key in rows) else _MISS
                 for rows in keys]
        agreed = self._agree_on_write_failure(local)
        self._plan = [(rows, hit == _HIT) for rows, hit in zip(keys, agreed)]
        device = microbatches[0]["input_ids"].device
        self._loaded = [self._reader.submit(self._load, rows, device) if hit and self.last_stage else None
                        for rows, hit in self._plan]
        self._cursor = {}

    def end_step(self) -> None:
        if any(count != len(self._plan) for count in self._cursor.values()):
            raise RuntimeError(f"trunk cache: the schedule ran {self._cursor} forwards per model chunk for a step of "
                               f"{len(self._plan)} microbatches")
        self._plan, self._loaded = [], []

    def finish(self) -> None:
        """At the end of training, on every rank: finish the writes in flight; raise everywhere if one failed."""
        self.close()
        self._agree_on_write_failure([])

    def close(self) -> None:
        """Finish the writes in flight; stop the threads (not collective: safe when a fit is failing)."""
        if self._writer.is_alive():
            self._write_queue.put(None)
            self._writer.join()
        self._reader.shutdown(wait=True)
        for hook in self._hooks:
            hook.remove()
        self._hooks = []

    def _agree_on_write_failure(self, local: list[int]) -> list[int]:
        """MIN-reduce `local` with this rank's write failure appended; raise on every rank when any rank failed."""
        failed = self._write_error is not None
        agreed = torch.tensor(local + [_FAILED if failed else _HIT], dtype=torch.int64)
        dist.all_reduce(agreed, op=dist.ReduceOp.MIN, group=cpu_group())
        if agreed[-1] == _FAILED:
            raise TrunkCacheWriteError(f"trunk cache: writing a shard under {self.shards} failed on "
                                       f"{'this' if failed else 'another'} rank ({self._write_error or 'see it'}); "
                                       f"it needs {self.bytes_per_token()} bytes per training token: free space or "
                                       "set trunk_cache_dir elsewhere (or null)")
        return agreed[:-1].tolist()

    def wrap(self, forward_step: Callable[[torch.nn.Module, Microbatch], torch.Tensor]
             ) -> Callable[[torch.nn.Module, Microbatch], torch.Tensor]:
        """`forward_step` reading and writing the cache while a training step is planned (else unchanged). A forward
        without autograd is not the step's, even while one is planned (the draft probe of a weight sync whose
        callback runs before MTPOnlyCallback's `on_train_batch_end`)."""

        def cached_forward_step(model: torch.nn.Module, microbatch: Microbatch) -> torch.Tensor:
            if not self._plan or not torch.is_grad_enabled():
                return forward_step(model, microbatch)  # validation, test, a probe
            index = self._cursor.get(id(model), 0)
            self._cursor[id(model)] = index + 1
            keys, hit = self._plan[index]
            if hit:
                return self._read_forward(model, microbatch, index)
            self._capturing = True
            try:
                output = forward_step(model, microbatch)
            finally:
                self._capturing = False
            hidden, self._captured = self._captured, None
            if hidden is not None and self.writes:
                ready = _recorded_event(hidden.device)
                for row, key in enumerate(keys):
                    if key not in self._pending and not self._shard(key).exists():
                        self._pending.add(key)
                        self._write_queue.put((key, _host_safe(hidden[:, row:row + 1]), ready))
            return output

        return cached_forward_step

    # ------------------------------------------------------------------ forwards

    def _capture(self, module: torch.nn.Module, args: tuple, output: Any) -> None:
        if self._capturing:
            self._captured = output.detach()

    def _read_forward(self, model: torch.nn.Module, microbatch: Microbatch, index: int) -> torch.Tensor:
        from megatron.core.utils import unwrap_model

        gpt = unwrap_model(model)
        if not (gpt.post_process and gpt.mtp_process):
            tokens = microbatch["input_ids"]  # this stage's output is not used: a placeholder of the shape sent on
            rows = tokens.shape[1] // (self.tp_size if self.sequence_parallel else 1)
            return torch.zeros(rows, tokens.shape[0], self.config.hidden_size, dtype=self.dtype, device=tokens.device)
        loaded = self._loaded[index]
        assert loaded is not None
        hidden = _on_current_stream(*loaded.result())
        self.reads += hidden.shape[1]  # rows
        received = gpt.decoder.input_tensor
        if received is not None:  # the previous stage's placeholder: its (zero) gradient is what the schedule sends
            hidden = ZeroGradientTie.apply(hidden, received)
        inputs = model_inputs(microbatch)
        _, rotary_pos_emb, rotary_pos_cos, rotary_pos_sin, sequence_len_offset, padding_mask = gpt._preprocess(
            input_ids=inputs["input_ids"], position_ids=inputs["position_ids"], decoder_input=hidden,
            packed_seq_params=inputs.get("packed_seq_params"))[:6]

        return gpt._postprocess(
            hidden_states=hidden, input_ids=inputs["input_ids"], position_ids=inputs["position_ids"],
            labels=inputs["labels"], rotary_pos_emb=rotary_pos_emb, rotary_pos_cos=rotary_pos_cos,
            rotary_pos_sin=rotary_pos_sin, mtp_in_postprocess=True, loss_mask=inputs["loss_mask"],
            decoder_input=hidden, attention_mask=inputs["attention_mask"], padding_mask=padding_mask,
            packed_seq_params=inputs.get("packed_seq_params"), sequence_len_offset=sequence_len_offset,
            output_processor=main_loss_processor(gpt))

    # ------------------------------------------------------------------ files

    def _shard(self, key: str) -> Path:
        return self.shards / key[:2] / f"{key}.safetensors"

    def _load(self, keys: list[str], device: torch.device) -> tuple[torch.Tensor, Any]:
        """The microbatch's rows, `hidden` `[s, b, h]`, on `device` (side stream)."""
        from safetensors.torch import load_file

        hidden = torch.cat([load_file(self._shard(key))["hidden"] for key in keys], dim=1)
        if device.type != "cuda":
            return hidden, None
        with torch.cuda.stream(self._side_stream):
            hidden = hidden.pin_memory().to(device, non_blocking=True)
            ready = torch.cuda.Event()
            ready.record()
        return hidden, ready

    def _to_host(self, hidden: torch.Tensor, ready: Any) -> dict[str, torch.Tensor]:
        """The row on the host; from the GPU on the write stream, so the copy does not queue behind the step's
        kernels on the default stream (the queue keeps the tensor alive until the synchronous copy is done)."""
        if ready is None:
            return {"hidden": hidden.contiguous()}
        with torch.cuda.stream(self._write_stream):
            self._write_stream.wait_event(ready)
            return {"hidden": hidden.to("cpu").contiguous()}

    def _write_loop(self) -> None:
        """Shards written from the host copies by `os.pwrite` (`write_host_tensors`), which releases the GIL:
        safetensors' `save_file` held it while copying each row's bytes, stalling the step's kernel launches
        beside it (0.232 s against 0.210 s per 0.6B first-epoch step on the H200)."""
        while (item := self._write_queue.get()) is not None:
            key, hidden, ready = item
            try:
                if self._write_error is None:  # after a failure: drain, the next step raises everywhere
                    tensors = self._to_host(hidden, ready)
                    layout = safetensors_layout([TensorSpec(name, tuple(tensor.shape), tensor.dtype)
                                                 for name, tensor in tensors.items()])
                    write_file_atomically(self._shard(key),
                                          lambda temporary: write_host_tensors(temporary, layout, tensors))
                    self.writes_done += 1
            except BaseException as error:  # noqa: BLE001 - reported on every rank by the next plan_step
                self._write_error = error
                _remove_empty_dirs(self._shard(key).parent)
            finally:
                self._pending.discard(key)
                self._write_queue.task_done()
        self._write_queue.task_done()


def _recorded_event(device: torch.device) -> Any:
    """An event on the current stream (what the writer's copy waits for), None on the CPU."""
    if device.type != "cuda":
        return None
    event = torch.cuda.Event()
    event.record()
    return event


def _host_safe(tensor: torch.Tensor) -> torch.Tensor:
    """What the writer thread may read later: a device tensor as it is (kept alive by the queue), a host tensor
    copied (the step may reuse its storage)."""
    tensor = tensor.detach()
    return tensor.clone() if tensor.device.type == "cpu" else tensor


def _on_current_stream(hidden: torch.Tensor, ready: Any) -> torch.Tensor:
    if ready is not None:
        stream = torch.cuda.current_stream()
        stream.wait_event(ready)
        hidden.record_stream(stream)
    return hidden


def _remove_empty_dirs(folder: Path) -> None:
    try:
        os.rmdir(folder)
    except OSError:
        pass


def open_trunk_cache(folder: str | Path, pl_module: Any, train_dataloader: Any,
                     frozen_checksums: dict[str, tuple[int, int]]) -> TrunkCache:
    """The fit's cache (collective), its `forward_step` installed on the module for the fit (`close_trunk_cache`
    takes it back)."""
    from megatron.core.utils import get_model_config, unwrap_model

    chunks = [unwrap_model(chunk) for chunk in pl_module.model]
    cache = TrunkCache(folder, frozen_weights=frozen_weights_hash(frozen_checksums),
                       data=training_data_hash(train_dataloader), chunks=chunks, config=get_model_config(chunks[0]))
    pl_module.forward_step = cache.wrap(pl_module.forward_step)
    return cache


def close_trunk_cache(pl_module: Any) -> None:
    vars(pl_module).pop("forward_step", None)

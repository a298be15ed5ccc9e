"""A stand-in inference engine: a `transformers` model in its own process, taking weight updates as SGLang does.

`WeightReceiver` serves, on 127.0.0.1, the subset of SGLang's HTTP API a trainer uses to push weights:
`/init_weights_update_group`, `/destroy_weights_update_group`, `/update_weights_from_distributed`,
`/update_weights_from_tensor`, `/update_weights_from_disk`, `/model_info` (with `weight_version`),
`/get_weights_by_name`, `/generate` (greedy), `/health`, `/load_lora_adapter` and `/unload_lora_adapter` (also under
vLLM's `/v1/...`: a PEFT folder served by name to the generation requests that name it in `lora_path`, over the
weights held; needs `peft`), plus `/validate_weights` (names, dtypes, shapes checked before any byte moves). The whole trainer -> engine loop is tested with it, without an inference engine installed;
it is also a small, honest engine for a notebook.

A delta (requests carrying `base_weight_version`, this package's extension: only the tensors that changed since
that version) is staged until its last request (the one with `weight_version`) and then applied at once; one whose
base is not the version held here is refused, naming both versions, and nothing changes. What a delta left staged
when its trainer died before the last request is dropped when the next update starts (its `/validate_weights`); a
full update's first request leaves the engine at no version (`weight_version` None) until its last one. Each
version keeps the `weight_version_metadata` its last request carried (or its folder's `weight_version.json`), read
back by `/model_info`: a rollout worker learns the quality of the draft head it serves.

Tensors are copied by HF name into the model's own tensors (a tied head follows its embedding); a checkpoint
tensor the model has no parameter for (an MTP head: a plain `transformers` model has none) is kept as a draft
tensor, as a speculative-decoding engine would load it. An unknown name, or a shape or dtype that differs, is
refused before anything is copied.

    python -m lightning_megatron.serving.receiver --checkpoint HF_FOLDER --port 30000
"""

from __future__ import annotations

import argparse
import copy
import importlib.util
import json
import os
import site
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterable
from datetime import timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from lightning_megatron.atomic import write_text_atomically
from lightning_megatron.hf_io import SAFETENSORS_DTYPES, TensorSpec, checkpoint_tensor_specs, safetensors_files
from lightning_megatron.serving.disk import VERSION_FILE, read_version_record
from lightning_megatron.serving.protocol import (
    WeightSyncError,
    broadcast,
    deserialize,
    destroy_process_group,
    dtype_from_name,
    dtype_name,
    init_custom_process_group,
    open_handle,
    specs_from_payload,
    unflatten,
)


class WeightReceiver:
    """Take SGLang-shaped weight updates for `model` over HTTP on `host:port` (port 0: a free one)."""

    def __init__(self, model: torch.nn.Module, checkpoint: str | Path, *, host: str = "127.0.0.1", port: int = 0,
                 timeout_s: float = 60.0) -> None:
        self.model = model.eval()
        self.checkpoint = Path(checkpoint)
        self.timeout_s = timeout_s
        self.weight_version: str | None = None
        self.version_metadata: dict[str, Any] | None = None
        self._delta: dict[str, torch.Tensor] = {}  # a delta's tensors until its last request
        self.tensors: dict[str, torch.Tensor] = dict(model.state_dict())
        device = next(model.parameters()).device
        self.draft_tensors = self._load_draft_tensors(device)
        self.groups: dict[str, tuple[Any, int]] = {}
        self.lora_adapters: dict[str, Path] = {}  # PEFT folders by name (`/load_lora_adapter`)
        self._lock = threading.Lock()
        self._server = ThreadingHTTPServer((host, port), _handler(self))
        self._thread: threading.Thread | None = None

    @classmethod
    def from_pretrained(cls, checkpoint: str | Path, *, device: str = "cpu", **kwargs: Any) -> WeightReceiver:
        """The checkpoint's `transformers` model in its own dtypes, on `device`."""
        import transformers

        if not (Path(checkpoint) / "config.json").is_file():  # not a name to look up on a hub: a local folder
            raise ValueError(f"checkpoint: {str(checkpoint)!r} is not an HF checkpoint folder (no config.json in it); "
                             "give the local folder the engine starts from (e.g. a disk sync's version folder)")
        model = transformers.AutoModelForCausalLM.from_pretrained(checkpoint, dtype="auto").to(device)
        return cls(model, checkpoint, **kwargs)

    @property
    def url(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}"

    def start(self) -> WeightReceiver:
        """Serve on a background thread."""
        self._thread = threading.Thread(target=self._server.serve_forever, name="weight-receiver", daemon=True)
        self._thread.start()
        return self

    def serve_forever(self) -> None:
        self._server.serve_forever()

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        for group, _ in self.groups.values():
            destroy_process_group(group)
        self.groups = {}

    def named_tensors(self) -> dict[str, torch.Tensor]:
        """Every tensor the engine serves under its checkpoint name: the model's and the draft's."""
        return {**self.tensors, **self.draft_tensors}

    # ------------------------------------------------------------------ requests (SGLang's shapes)

    def init_weights_update_group(self, request: dict[str, Any]) -> dict[str, Any]:
        name = request.get("group_name", "weight_update_group")
        if name in self.groups:
            destroy_process_group(self.groups.pop(name)[0])
        rank = int(request.get("rank_offset", 1))
        group = init_custom_process_group(request.get("backend", "nccl"), request["master_address"],
                                          int(request["master_port"]), rank, int(request["world_size"]), name,
                                          timedelta(seconds=self.timeout_s))
        self.groups[name] = (group, rank)
        return {"success": True, "message": f"joined {name} as rank {rank}"}

    def destroy_weights_update_group(self, request: dict[str, Any]) -> dict[str, Any]:
        group = self.groups.pop(request.get("group_name", "weight_update_group"), None)
        if group is not None:
            destroy_process_group(group[0])
        return {"success": True, "message": "destroyed"}

    def validate_weights(self, request: dict[str, Any]) -> dict[str, Any]:
        """The manifest of the update about to start: it also drops what an update that never finished staged (a
        delta whose trainer died before its last request), so that it is not applied with this one."""
        self._delta = {}
        self._check(specs_from_payload(request))
        return {"success": True, "message": "names, dtypes and shapes match"}

    def update_weights_from_distributed(self, request: dict[str, Any]) -> dict[str, Any]:
        specs = specs_from_payload(request)
        self._check(specs)
        group_name = request.get("group_name", "weight_update_group")
        if group_name not in self.groups:
            raise WeightSyncError(f"no weight update group {group_name!r}; call /init_weights_update_group first")
        group = self.groups[group_name][0]
        device = next(self.model.parameters()).device
        if request.get("load_format") == "flattened_bucket":
            buffer = torch.empty(sum(spec.nbytes for spec in specs), dtype=torch.uint8, device=device)
            broadcast(group, buffer, self.timeout_s)
            self._apply(request, unflatten(buffer, specs))
        else:
            received = []
            for spec in specs:
                tensor = torch.empty(spec.shape, dtype=spec.dtype, device=device)
                broadcast(group, tensor, self.timeout_s)
                received.append((spec.name, tensor))
            self._apply(request, received)
        return self._updated(request, len(specs))

    def update_weights_from_tensor(self, request: dict[str, Any]) -> dict[str, Any]:
        # one entry per engine TP rank; this engine has one
        payload = deserialize(request["serialized_named_tensors"][0])
        if request.get("load_format") == "flattened_bucket":
            specs = [TensorSpec(entry["name"], tuple(entry["shape"]), dtype_from_name(entry["dtype"]))
                     for entry in payload["metadata"]]
            self._check(specs)
            self._apply(request, unflatten(open_handle(payload["flattened_tensor"]), specs))
        else:
            named = [(name, open_handle(tensor)) for name, tensor in payload]
            specs = [TensorSpec(name, tuple(tensor.shape), tensor.dtype) for name, tensor in named]
            self._check(specs)
            self._apply(request, named)
        device = next(self.model.parameters()).device
        if device.type == "cuda":  # the sender reuses its buffer once answered: the copies out of it are done first
            torch.cuda.current_stream(device).synchronize()
        return self._updated(request, len(specs))

    def update_weights_from_disk(self, request: dict[str, Any]) -> dict[str, Any]:
        path = Path(request["model_path"])
        files = self._read_headers(path)  # every file readable, complete and matching, before any byte is loaded
        names = {spec.name for specs in files.values() for spec in specs}
        missing = sorted(set(checkpoint_tensor_specs(self.checkpoint)) - names)
        if missing:
            raise WeightSyncError(f"{path} lacks {len(missing)} tensor(s) the engine serves, e.g. {missing[:5]}")
        try:  # read before any weight is loaded: the weights and the version that names them change together
            record = read_version_record(path)
        except (OSError, ValueError) as error:
            raise WeightSyncError(f"{path / VERSION_FILE} cannot be read as JSON ({error}); nothing was loaded") \
                from error
        device = next(self.model.parameters()).device
        self._no_version()
        for file in files:
            with safe_open(file, framework="pt", device=str(device)) as reader:  # read onto the engine's device
                self._load((name, reader.get_tensor(name)) for name in reader.keys())
        self.checkpoint = path
        self._delta = {}
        return self._updated({**request, "weight_version_metadata": record}, len(names))

    def _read_headers(self, path: Path) -> dict[Path, list[TensorSpec]]:
        """Each safetensors file of `path` and its tensors, from the headers: a file that cannot be opened (missing
        permissions, zero length, truncated: safetensors checks that the data covers the file exactly) or whose
        tensors this engine does not serve as they are is refused by name, and nothing is loaded."""
        files = safetensors_files(path)
        if not files:
            raise WeightSyncError(f"model_path: {path} holds no *.safetensors file; nothing was loaded")
        headers = {}
        for file in files:
            try:
                with safe_open(file, framework="pt") as reader:
                    slices = {name: reader.get_slice(name) for name in reader.keys()}
                    headers[file] = [TensorSpec(name, tuple(part.get_shape()), SAFETENSORS_DTYPES[part.get_dtype()])
                                     for name, part in slices.items()]
            except Exception as error:  # safetensors' own error type, OSError, an unknown dtype
                raise WeightSyncError(f"{file} cannot be read as a safetensors file ({type(error).__name__}: "
                                      f"{error}); nothing was loaded") from error
            self._check(headers[file], source=file)
        return headers

    def model_info(self, request: dict[str, Any]) -> dict[str, Any]:
        return {"model_path": str(self.checkpoint), "weight_version": self.weight_version, "is_generation": True,
                "weight_version_metadata": self.version_metadata}

    def get_weights_by_name(self, request: dict[str, Any]) -> Any:
        tensor = self.named_tensors()[request["name"]]
        limit = request.get("truncate_size")
        flat = tensor.detach().float().cpu().reshape(-1)
        return {"dtype": dtype_name(tensor.dtype), "shape": list(tensor.shape),
                "values": (flat if limit is None else flat[:limit]).tolist()}

    def generate(self, request: dict[str, Any]) -> dict[str, Any]:
        """Greedy continuation of `input_ids` (SGLang's `sampling_params.max_new_tokens`), with the LoRA adapter
        named in `lora_path` if any."""
        device = next(self.model.parameters()).device
        input_ids = torch.tensor([request["input_ids"]], device=device)
        new_tokens = int(request.get("sampling_params", {}).get("max_new_tokens", 16))
        adapter = request.get("lora_path")
        if adapter is not None and adapter not in self.lora_adapters:
            raise WeightSyncError(f"lora_path: no LoRA adapter {adapter!r} is loaded (loaded: "
                                  f"{sorted(self.lora_adapters)}); load it with /load_lora_adapter first")
        model = self.model if adapter is None else self._adapted(self.lora_adapters[adapter])
        with torch.no_grad():
            output = model.generate(input_ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                                    do_sample=False, attention_mask=torch.ones_like(input_ids))
        return {"output_ids": output[0, input_ids.shape[1]:].tolist(), "weight_version": self.weight_version}

    def load_lora_adapter(self, request: dict[str, Any]) -> dict[str, Any]:
        """SGLang's `/load_lora_adapter` (vLLM's `/v1/load_lora_adapter`): the PEFT folder `lora_path`, served as
        `lora_name` over the weights held (merged into a copy at each generation); one that does not load onto this
        model, or a name already loaded, is refused and nothing changes."""
        name, path = request["lora_name"], Path(request["lora_path"])
        if name in self.lora_adapters:  # as vLLM answers (without load_inplace): one adapter per name until unloaded
            raise WeightSyncError(f"lora_name: an adapter {name!r} is loaded already (from "
                                  f"{self.lora_adapters[name]}); unload it first (/unload_lora_adapter)")
        self._adapted(path)
        self.lora_adapters[name] = path
        return {"success": True, "message": f"loaded LoRA adapter {name!r} from {path}"}

    def unload_lora_adapter(self, request: dict[str, Any]) -> dict[str, Any]:
        self.lora_adapters.pop(request["lora_name"], None)
        return {"success": True, "message": f"unloaded LoRA adapter {request['lora_name']!r}"}

    def _adapted(self, folder: Path) -> torch.nn.Module:
        """A copy of the model with the PEFT adapter in `folder` merged in."""
        try:
            from lightning_megatron._compat import import_peft

            peft = import_peft()
        except ImportError as error:
            raise WeightSyncError("serving LoRA adapters needs peft (pip install peft)") from error
        try:
            return peft.PeftModel.from_pretrained(copy.deepcopy(self.model), str(folder)).merge_and_unload().eval()
        except Exception as error:  # a missing or broken folder, an adapter of another model: peft's own errors
            raise WeightSyncError(f"lora_path: {folder} does not load as a PEFT adapter of this model "
                                  f"({type(error).__name__}: {error}); nothing was loaded") from error

    def health(self, request: dict[str, Any]) -> dict[str, Any]:
        return {"success": True}

    # ------------------------------------------------------------------ checks and copies

    def _check(self, specs: list[TensorSpec], source: Path | None = None) -> None:
        served = self.named_tensors()
        unknown = [spec.name for spec in specs if spec.name not in served]
        mismatched = [f"{spec.name}: sent as {spec.shape} {dtype_name(spec.dtype)}, served as "
                      f"{tuple(served[spec.name].shape)} {dtype_name(served[spec.name].dtype)}"
                      for spec in specs if spec.name in served
                      and (tuple(served[spec.name].shape) != spec.shape or served[spec.name].dtype != spec.dtype)]
        if unknown or mismatched:
            raise WeightSyncError(f"nothing was loaded: {'' if source is None else f'{source}: '}{len(unknown)} "
                                  f"name(s) this model and its draft do not have (e.g. {unknown[:3]}); "
                                  f"{len(mismatched)} shape or dtype mismatch(es) (e.g. {mismatched[:3]})")

    def _load(self, named: Iterable[tuple[str, torch.Tensor]]) -> None:
        served = self.named_tensors()
        with torch.no_grad():
            for name, tensor in named:
                served[name].copy_(tensor)

    def _apply(self, request: dict[str, Any], named: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load a full sync's tensors now; stage a delta's until its last request, then load them all at once."""
        base = request.get("base_weight_version")
        if base is None:
            self._delta = {}
            self._no_version()
            self._load(named)
            return
        if str(base) != self.weight_version:
            self._delta = {}
            raise WeightSyncError(f"a delta onto weight version {base} cannot apply: this engine holds version "
                                  f"{self.weight_version}; nothing was changed (send a full sync)")
        if request.get("weight_version") is None:
            self._delta.update((name, tensor.clone()) for name, tensor in named)  # the sender reuses its buffer
            return
        delta, self._delta = self._delta, {}
        self._load([*delta.items(), *named])  # the last request's tensors straight from its buffer

    def _no_version(self) -> None:
        """Weights are being replaced in place: until the update's last request they are no version's (an update
        whose trainer dies half-way leaves a mix; claiming the old version would let a delta onto it apply)."""
        self.weight_version = None
        self.version_metadata = None

    def _updated(self, request: dict[str, Any], count: int) -> dict[str, Any]:
        if request.get("weight_version") is not None:
            self.weight_version = str(request["weight_version"])
            self.version_metadata = request.get("weight_version_metadata")
        return {"success": True, "message": f"loaded {count} tensor(s)", "num_paused_requests": 0}

    def _load_draft_tensors(self, device: torch.device) -> dict[str, torch.Tensor]:
        draft = {}
        for file in safetensors_files(self.checkpoint):
            with safe_open(file, framework="pt") as reader:
                for name in reader.keys():
                    if name not in self.tensors:
                        draft[name] = reader.get_tensor(name).to(device)
        return draft

    def _handle(self, route: str, request: dict[str, Any]) -> Any:
        routes = {"init_weights_update_group": self.init_weights_update_group,
                  "destroy_weights_update_group": self.destroy_weights_update_group,
                  "validate_weights": self.validate_weights,
                  "update_weights_from_distributed": self.update_weights_from_distributed,
                  "update_weights_from_tensor": self.update_weights_from_tensor,
                  "update_weights_from_disk": self.update_weights_from_disk,
                  "model_info": self.model_info, "get_model_info": self.model_info,
                  "get_weights_by_name": self.get_weights_by_name, "generate": self.generate, "health": self.health,
                  "load_lora_adapter": self.load_lora_adapter, "v1/load_lora_adapter": self.load_lora_adapter,
                  "unload_lora_adapter": self.unload_lora_adapter, "v1/unload_lora_adapter": self.unload_lora_adapter}
        if route not in routes:
            raise KeyError(route)
        if route in ("health", "model_info", "get_model_info"):
            return routes[route](request)
        with self._lock:  # one update (or generation) at a time
            return routes[route](request)


def _handler(receiver: WeightReceiver) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self._answer({})

        def do_POST(self) -> None:
            length = int(self.headers.get("Content-Length") or 0)
            self._answer(json.loads(self.rfile.read(length) or b"{}"))

        def _answer(self, request: dict[str, Any]) -> None:
            route = self.path.strip("/").split("?")[0]
            try:
                status, reply = 200, receiver._handle(route, request)
            except KeyError as error:
                status, reply = (404, {"success": False, "message": f"no route /{route}"}) if error.args == (route,) \
                    else (400, {"success": False, "message": f"unknown tensor {error}"})
            except (WeightSyncError, ValueError, RuntimeError) as error:
                status, reply = 400, {"success": False, "message": str(error)}
            except Exception as error:  # whatever else failed: answered, never a dropped connection
                status, reply = 500, {"success": False, "message": f"{type(error).__name__}: {error}"}
            body = json.dumps(reply).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: Any) -> None:  # quiet: one line per request is noise here
            pass

    return Handler


def child_pythonpath() -> str:
    """`PYTHONPATH` for a `sys.executable -m lightning_megatron...` child, so that it imports this process's package.

    An installed package (a site directory) needs nothing: the child has the same site directories, and one put on
    `PYTHONPATH` would come before the standard library. A package imported from elsewhere (a checkout, through the
    editable finder, the current folder or a `sys.path` edit such as pytest's `pythonpath`) gets the folder that
    holds it ahead of the inherited `PYTHONPATH`.
    """
    inherited = os.environ.get("PYTHONPATH", "")
    package = importlib.util.find_spec("lightning_megatron")
    import_root = os.path.realpath(os.path.dirname(os.path.dirname(package.origin)))
    site_directories = {os.path.realpath(path) for path in (*site.getsitepackages(), site.getusersitepackages())}
    if import_root in site_directories:
        return inherited
    return os.pathsep.join(filter(None, [import_root, inherited]))


def spawn_receiver(checkpoint: str | Path, *, port: int = 0, device: str = "cpu", timeout_s: float = 60.0,
                   log: str | Path | None = None, startup_s: float = 300.0) -> tuple[subprocess.Popen, str]:
    """Start a receiver for `checkpoint` in a new process; returns the process and its URL once it serves."""
    ready = Path(tempfile.mkdtemp(prefix="weight-receiver-")) / "url"
    command = [sys.executable, "-m", "lightning_megatron.serving.receiver", "--checkpoint", str(checkpoint),
               "--port", str(port), "--device", device, "--timeout-s", str(timeout_s), "--ready-file", str(ready)]
    env = {**os.environ, "PYTHONPATH": child_pythonpath()}
    if log is None:
        process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT, env=env)
    else:
        with open(log, "ab") as output:  # the child keeps its own copy of the descriptor
            process = subprocess.Popen(command, stdout=output, stderr=subprocess.STDOUT, env=env)
    deadline = time.monotonic() + startup_s
    while not ready.is_file():
        if process.poll() is not None or time.monotonic() > deadline:
            process.kill()
            raise RuntimeError(f"the weight receiver for {checkpoint} did not start (exit code {process.poll()})")
        time.sleep(0.1)
    return process, ready.read_text().strip()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint", required=True, help="the HF checkpoint the engine starts from")
    parser.add_argument("--port", type=int, default=30000)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--timeout-s", type=float, default=60.0)
    parser.add_argument("--ready-file", default=None, help="write the URL here once serving (for scripts)")
    args = parser.parse_args()
    receiver = WeightReceiver.from_pretrained(args.checkpoint, device=args.device, port=args.port,
                                              timeout_s=args.timeout_s)
    if args.ready_file:  # written whole, then renamed: a reader never sees a partial URL
        write_text_atomically(Path(args.ready_file), receiver.url + "\n", mode=0o644)
    print(f"serving {args.checkpoint} at {receiver.url}", flush=True)
    receiver.serve_forever()


if __name__ == "__main__":
    main()

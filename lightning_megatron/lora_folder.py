"""The PEFT adapter folder a LoRA export writes: its layout (`AdapterPlan`) and, for a model whole on every rank,
its bytes copied straight from the adapters' parameters (`CopyPlan`).

Why a copy plan: megatron-bridge's adapter export of a model without tensor, pipeline or expert parallelism only
picks pieces of the adapters' parameters (a fused QKV's B split per projection and query group, a gate/up B halved,
an A yielded once per projection that shares it): no arithmetic, no gather. Yet it costs Python time per tensor, ~70
ms for the 518 tensors of Qwen3-8B's adapters on every linear, each weight sync. `find_copy_plan` finds the pieces
once by two probes of the export: id-valued parameters say which element each exported one is, random ones in the
parameters' own dtype must then come out equal to the pieces bit for bit (an export that computes, a cast or a
rounding that kept ids whole, fails it). Then a write is one concatenation on the device and one copy into the spare
file (below), or one staged write. What it refuses (None, and the export runs every time): exported tensors that are
not pieces, packed experts (`file_names` None), dtypes other than the parameters', a file whose data is not the
pieces back to back. Knows no Lightning and no Megatron-Core: `lora.py` brings the export and decides who probes.

Why a spare file: what is left of a copy plan's write is the write itself, and on tmpfs (`/dev/shm`, where a
weight sync's versions live) a good part of a fresh file's write time is the kernel allocating and zeroing its
pages: 90 MB took 28.7 ms into a new file and 21.9 ms into a preallocated one (`os.posix_fallocate`) on the H100
machine, 31 and 15 ms on a 2-core CPU machine (`bench/results/h100_2026-12-06b/`). So after each write a
thread preallocates the next file beside the folder (`atomic.preallocate_spare`: hidden, removed when the plan goes,
at exit and by `serving.disk.remove_partials`), and the next write takes it into its folder and writes over it
(`atomic.take_spare`). The engine reading the last version is never touched: the spare is a new file, never one a
version held.

Why mapped: even into preallocated pages, `pwrite` copies the bytes a second time (from the pinned staging buffer
into the page cache, one file at a time under its inode lock: 90 MB in 21 ms on the H100 machine, as long as 1% of
the merged sync). So the same thread maps the spare into this process (`mmap`, shared), writes the file's header
into it, and, for adapters on a GPU, registers its pages with CUDA (`cudaHostRegister`): the write is then one copy
from the device straight into the file's pages, by DMA, with no staging and no write call (2 ms for the 90 MB,
`bench/results/h100_2026-12-06d/`). A file system that cannot map, or CUDA refusing the registration, leaves the
staged write or a copy through the driver's own staging; the mapping is released (unregistered, unmapped) by the
next preparation's thread, off the sync. The preparation takes tens of milliseconds (the registration 30 ms for 90
MB on the H100 machine), which the training steps between two syncs overlap; a write that comes before it ended
(syncs back to back) does not wait: it writes staged, and the spare serves the write after. torch's binding of
`cudaHostRegister` keeps the GIL: the training thread may wait that long once per sync.
"""

from __future__ import annotations

import itertools
import mmap
import os
import threading
import weakref
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from lightning_megatron.atomic import SPARE_FILE_PREFIX, preallocate_spare, take_spare
from lightning_megatron.hf_io import TensorSpec
from lightning_megatron.staged_write import FileLayout, StagedWriter

ADAPTER_FILE = "adapter_model.safetensors"
ADAPTER_CONFIG_FILE = "adapter_config.json"
_SPARE_NUMBERS = itertools.count()  # a spare's name: the adapter file's, the process id and one of these


@dataclass(frozen=True)
class AdapterPlan:
    """A PEFT folder's layout, from the adapters one export yielded (`exported`: names, shapes and dtypes in the
    export's order) and the settings (`LoRA` type, rank, alpha, dropout, base model): `adapter_config.json`'s text,
    the safetensors file's layout and, where PEFT stores every exported tensor as it is (not packed experts), the
    name each goes under in the file (`file_names`)."""

    exported: tuple[TensorSpec, ...]
    settings: tuple[Any, ...]
    config_text: str
    layout: FileLayout
    file_names: Mapping[str, str] | None


# The exported tensors' provenance is probed with each adapter parameter's elements replaced by float64 ids:
# parameter index * ID_STRIDE + element index (exact below 2**53: up to 2**21 parameters of 2**32 elements).
ID_STRIDE = 2**32

# an export with the parameters' data replaced by these stand-ins: {exported name: tensor}
ExportWith = Callable[[list[torch.Tensor]], dict[str, torch.Tensor]]


class MappedSpare:
    """A spare file's pages mapped into this process, its header already written: `pages[len(prefix):]` is where
    the adapters' bytes go. Registered with CUDA for a copy from a GPU when `register` and CUDA agrees (`refusal`
    says why not: a copy into pages not registered goes through the driver's staging)."""

    def __init__(self, path: Path, prefix: bytes, size: int, *, register: bool) -> None:
        descriptor = os.open(path, os.O_RDWR)
        try:
            self._map = mmap.mmap(descriptor, size)  # shared, read and write: the file's own pages
        finally:
            os.close(descriptor)
        self._map[:len(prefix)] = prefix
        self.pages = torch.frombuffer(self._map, dtype=torch.uint8)
        self.refusal = _register_with_cuda(self.pages) if register else "not asked"
        self.registered = self.refusal is None

    def close(self) -> None:
        """Unregister and unmap (the file keeps its bytes)."""
        if self.registered:
            torch.cuda.cudart().cudaHostUnregister(self.pages.data_ptr())
            self.registered = False
        del self.pages  # the map's last export: it can close now
        try:
            self._map.close()
        except BufferError:  # a view outlived the write (held by a traceback): unmapped when it goes
            pass


def _register_with_cuda(pages: torch.Tensor) -> str | None:
    """Page-lock `pages` for DMA from the GPU (`cudaHostRegisterPortable`); None, or why CUDA refused."""
    try:
        error = torch.cuda.cudart().cudaHostRegister(pages.data_ptr(), pages.numel(), 1)
    except (RuntimeError, AttributeError) as refusal:
        return f"{type(refusal).__name__}: {refusal}"
    return None if int(error) == 0 else f"cudaHostRegister returned {error} ({int(error)})"


def _release(path: Path | None, mappings: list[MappedSpare]) -> None:
    """Close every mapping a spare file left, then remove the spare not taken (`path`, if any)."""
    while mappings:
        mappings.pop().close()
    if path is not None:
        path.unlink(missing_ok=True)


class SpareFile:
    """The next adapter file, preallocated and mapped on a thread of its own (the module's docstring says why). Best
    effort: a file system that cannot preallocate or map, or another size, leaves the write as it was. A spare left
    over goes when the plan does, or at exit."""

    def __init__(self) -> None:
        self._path: Path | None = None
        self._thread: threading.Thread | None = None
        self._mappings: list[MappedSpare] = []  # the prepared spare's (last), and one taken and written since
        self._removal: weakref.finalize | None = None
        self._settings: tuple[Path, bytes, int, bool] | None = None  # the pending spare's `prepare` arguments

    def prepare(self, directory: Path, prefix: bytes, size: int, *, register: bool) -> None:
        """Start preparing a spare of `size` bytes in `directory` (where the next version's folder is staged), its
        header `prefix` written, its pages registered with CUDA when `register`. A spare of the same settings not
        taken yet (its preparation had not ended when the last write came) is kept for the next write instead."""
        settings = (Path(directory), prefix, size, register)
        if self._path is not None and self._settings == settings:
            return
        self.discard()
        self._settings = settings
        name = f"{ADAPTER_FILE}-{os.getpid()}-{next(_SPARE_NUMBERS)}"
        self._path = directory / f"{SPARE_FILE_PREFIX}{name}"
        self._removal = weakref.finalize(self, _release, self._path, self._mappings)  # also runs at exit
        self._thread = threading.Thread(target=self._prepare, args=(directory, name, prefix, size, register),
                                        name="adapter-spare", daemon=True)
        self._thread.start()

    def _prepare(self, directory: Path, name: str, prefix: bytes, size: int, register: bool) -> None:
        _release(None, self._mappings)  # the last write's mapping: its bytes are in the file
        path = preallocate_spare(directory, name, size)
        if path is not None:
            try:
                self._mappings.append(MappedSpare(path, prefix, size, register=register))
            except (OSError, ValueError):  # no mapping on this file system: the staged write fills the spare
                pass

    def wait(self) -> Path | None:
        """The spare, once its preparation ended (None: none prepared)."""
        if self._thread is not None:
            self._thread.join()
        return self._path

    def mapping(self) -> MappedSpare | None:
        """The prepared spare's mapping, once its preparation ended (None: no spare, or not mapped)."""
        return self._mappings[-1] if self.wait() is not None and self._mappings else None

    def move_to(self, target: Path, size: int) -> MappedSpare | None:
        """Take the spare into `target` when it is ready and of `size` bytes; its mapping, where the bytes are to be
        copied (None: none taken, or not mapped, and the writer writes `target`). A spare still being prepared (a
        write right after the last one) is not waited for: it stays for the next write."""
        if self._thread is not None and self._thread.is_alive():
            return None
        mapping = self.mapping()
        path = self._forget()
        if path is not None and take_spare(path, target, size):
            return mapping
        _release(None, self._mappings)
        return None

    def discard(self) -> None:
        """Remove a spare not taken, with its mapping (one taken is released by the next preparation's thread)."""
        if (path := self._forget()) is not None:
            _release(path, self._mappings)

    def _forget(self) -> Path | None:
        """The spare once ready, no longer this object's to remove (its mapping stays until released)."""
        path = self.wait()
        if self._removal is not None:
            self._removal.detach()
        self._path = self._thread = self._removal = self._settings = None
        return path


@dataclass(frozen=True)
class CopyPlan:
    """Where every byte of the adapter file comes from: the concatenation of `pieces` (views of the parameters,
    contiguous runs of their elements, in file order) after `folder_plan`'s header. It holds the parameters it read
    (and so their memory) until it is replaced; a parameter whose memory moved, other parameters or other settings
    are not served (`serves`), and the export runs again."""

    folder_plan: AdapterPlan
    parameters: tuple[torch.nn.Parameter, ...]
    addresses: tuple[int, ...]  # each parameter's data_ptr when probed
    pieces: tuple[torch.Tensor, ...]
    spare: SpareFile = field(default_factory=SpareFile, compare=False)

    def serves(self, settings: tuple[Any, ...], parameters: list[torch.nn.Parameter]) -> bool:
        return (settings == self.folder_plan.settings and len(parameters) == len(self.parameters)
                and all(mine is theirs and mine.data_ptr() == address
                        for mine, theirs, address in zip(self.parameters, parameters, self.addresses)))

    def write_folder(self, extra_files: Mapping[str, str], folder: Path) -> None:
        """The folder from the parameters as they are now: the adapter file, its config, the extra files."""
        layout = self.folder_plan.layout
        data = torch.cat(self.pieces) if len(self.pieces) > 1 else self.pieces[0]
        size = len(layout.prefix) + data.nbytes
        mapping = self.spare.move_to(folder / ADAPTER_FILE, size)
        if mapping is not None:  # the header is there: the data straight into the file's pages
            mapping.pages[len(layout.prefix):].copy_(data.reshape(-1).view(torch.uint8))
        else:
            with StagedWriter({folder / ADAPTER_FILE: FileLayout(layout.prefix, {"data": (len(layout.prefix),
                                                                                          data.nbytes)})},
                              threads=1) as writer:
                writer.write("data", data)
        write_config_and_extras(folder, self.folder_plan.config_text, extra_files)
        self.spare.prepare(folder.parent, layout.prefix, size, register=data.is_cuda)


def write_config_and_extras(folder: Path, config_text: str, extra_files: Mapping[str, str]) -> None:
    """The folder's `adapter_config.json` and the caller's extra files (a version's metadata), beside the adapters."""
    (folder / ADAPTER_CONFIG_FILE).write_text(config_text)
    for name, text in extra_files.items():
        (folder / name).write_text(text)


def probeable(parameters: list[torch.nn.Parameter]) -> bool:
    """Whether every element of the parameters gets an exact id, and their pieces can be views."""
    return (len(parameters) < 2**53 // ID_STRIDE
            and all(parameter.numel() < ID_STRIDE and parameter.is_contiguous() for parameter in parameters))


def find_copy_plan(export_with: ExportWith, folder_plan: AdapterPlan,
                   parameters: list[torch.nn.Parameter]) -> CopyPlan | None:
    """The runs of parameter elements that make each exported tensor, in the file's order, checked by the random
    probe; None where they do not make the file (see the module's docstring)."""
    file_names = folder_plan.file_names
    if file_names is None or not probeable(parameters):
        return None
    ids = [torch.arange(index * ID_STRIDE, index * ID_STRIDE + parameter.numel(), dtype=torch.float64,
                        device=parameter.device).view(parameter.shape) for index, parameter in enumerate(parameters)]
    probed = export_with(ids)
    specs = {spec.name: spec for spec in folder_plan.exported}
    regions = folder_plan.layout.regions
    if sorted(probed) != sorted(specs) or len(regions) != len(probed):
        return None
    placed: list[tuple[int, str, list[tuple[int, int, int]]]] = []
    for name, tensor in probed.items():
        spec, region = specs[name], regions.get(file_names[name])
        runs = None if region is None or tuple(tensor.shape) != spec.shape else _runs(tensor.reshape(-1), parameters)
        if runs is None or any(parameters[owner].dtype != spec.dtype for owner, _, _ in runs):
            return None
        placed.append((region[0], name, runs))
    placed.sort(key=lambda item: item[0])
    offset = len(folder_plan.layout.prefix)
    for start, name, _ in placed:  # back to back from the header on: the data section is the runs in order
        if start != offset:
            return None
        offset += specs[name].nbytes
    generator = torch.Generator(device=parameters[0].device).manual_seed(0)
    noise = [torch.randn(parameter.shape, generator=generator, device=parameter.device).to(parameter.dtype)
             for parameter in parameters]
    exported = export_with(noise)
    if any(not torch.equal(exported[name].reshape(-1).to(noise[0].device), torch.cat(_views(runs, noise)))
           for _, name, runs in placed):
        return None
    pieces = _views([run for _, _, runs in placed for run in runs], [parameter.data for parameter in parameters])
    return CopyPlan(folder_plan, tuple(parameters), tuple(parameter.data_ptr() for parameter in parameters),
                    tuple(pieces))


def with_stand_ins(export: Callable[[], Any], parameters: list[torch.nn.Parameter],
                   stand_ins: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    """What `export()` yields (name, tensor pairs) with the parameters' data replaced by `stand_ins`, under no_grad;
    the parameters get their own data back whatever happens."""
    own = [parameter.data for parameter in parameters]
    try:
        with torch.no_grad():
            for parameter, stand_in in zip(parameters, stand_ins, strict=True):
                parameter.data = stand_in
            return {name: tensor.detach().clone() for name, tensor in export()}
    finally:
        for parameter, data in zip(parameters, own, strict=True):
            parameter.data = data


def _runs(ids: torch.Tensor, parameters: list[torch.nn.Parameter]) -> list[tuple[int, int, int]] | None:
    """`ids` (the id probe's values) as runs (parameter index, first element, length) of consecutive elements of
    one parameter each; None where a value is no element's id."""
    if ids.dtype != torch.float64:
        return None
    owner = torch.div(ids, ID_STRIDE, rounding_mode="floor")
    element = ids - owner * ID_STRIDE
    if not bool((element == element.round()).all()) or not bool(((owner >= 0) & (owner < len(parameters))).all()):
        return None
    owner, element = owner.long(), element.long()
    breaks = torch.ones(ids.numel(), dtype=torch.bool, device=ids.device)
    breaks[1:] = (owner[1:] != owner[:-1]) | (element[1:] != element[:-1] + 1)
    starts = torch.nonzero(breaks).flatten().tolist() + [ids.numel()]
    runs = [(source, first, end - begin) for begin, end, source, first in
            zip(starts[:-1], starts[1:], owner[starts[:-1]].tolist(), element[starts[:-1]].tolist())]
    if any(first + length > parameters[source].numel() for source, first, length in runs):
        return None
    return runs


def _views(runs: list[tuple[int, int, int]], data: list[torch.Tensor]) -> list[torch.Tensor]:
    return [data[source].reshape(-1)[first:first + length] for source, first, length in runs]

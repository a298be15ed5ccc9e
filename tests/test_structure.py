"""The floor plan as executable rules, read from the source with `ast` (`tests/_source.py`; no Megatron, no GPU):
no import circles; the floors of DESIGN.md (a room imports only rooms on its own floor or lower; every folder is one
room on one floor); the README's floor table equal to `FLOORS`; the ground-floor leaves and the `_compat` leaf; the
strategy apart from `SFTModule`'s file (it knows modules through `contract.py`); no contract attribute looked up by
name; the lazy export table; no file of the package or of `tests/` over 500 lines; no private name imported from
another module; `tests/` mirroring the package; one stage-then-rename; and the rooms that must import neither
Lightning nor Megatron-Core.
"""

from __future__ import annotations

import ast
import json
import os
import re
import subprocess
import sys

import pytest

from tests._source import (
    PACKAGE,
    ROOT,
    TOP,
    attributes_by_name,
    defines_class,
    find_cycle,
    import_graph,
    imports,
    modules,
    private_imports,
    reachable,
    renames,
    syntax,
    top_level_names,
)

MAX_LINES = 500

# The floor of every room, from the top down. A room is a top-level module, a top-level folder (all its modules and
# sub-folders: one floor per folder) or the package's own `__init__.py` (TOP). This table is the one source of truth:
# the README's "Where things are" table must list the same rooms on the same floors (test_readme_floor_table...).
FLOORS: dict[str, int] = {
    # 5: commands and the recipes that drive them
    "lightning_megatron.cli": 5,
    "lightning_megatron.recipes": 5,
    # apart: tiny HF checkpoints made locally; only the commands and recipes (and tests) use them
    "lightning_megatron.testing": 5,
    # the public facade: its `_EXPORTS` table names rooms up to the callbacks, so nothing in the package imports it
    "lightning_megatron": 5,
    # 4: every Lightning callback, thin adapters
    "lightning_megatron.callbacks": 4,
    # 3: the strategy and what it drives; the contract it calls; the modules above the contract
    "lightning_megatron.strategy": 3,
    "lightning_megatron.checkpoint": 3,
    "lightning_megatron.background_save": 3,
    "lightning_megatron.schedule": 3,
    "lightning_megatron.cuda_graphs": 3,
    "lightning_megatron.contract": 3,
    "lightning_megatron.module": 3,
    "lightning_megatron.lora": 3,
    "lightning_megatron.lora_folder": 3,
    "lightning_megatron.vl": 3,
    # 2: bridges (the VL bridge glue among them), MTP, serving, speculative decoding and their helpers
    "lightning_megatron.bridges": 2,
    "lightning_megatron.mtp": 2,
    "lightning_megatron.serving": 2,
    "lightning_megatron.speculative": 2,
    "lightning_megatron.moe": 2,
    "lightning_megatron.optimizer": 2,
    "lightning_megatron.safe_load": 2,
    "lightning_megatron.generate": 2,
    # 1: the attention core, data, tree rotary
    "lightning_megatron.attention": 1,
    "lightning_megatron.attention_layout": 1,
    "lightning_megatron.attention_varlen": 1,
    "lightning_megatron.data": 1,
    "lightning_megatron.tree_rotary": 1,
    # 0: ground-floor leaves
    "lightning_megatron.microbatch": 0,
    "lightning_megatron.options": 0,
    "lightning_megatron.distributed": 0,
    "lightning_megatron.atomic": 0,
    "lightning_megatron.hf_io": 0,
    "lightning_megatron.staged_write": 0,
    "lightning_megatron.families": 0,
    # apart: the compatibility leaf, which any floor may use (it imports only `families`, see
    # test_compat_is_a_leaf); DESIGN.md keeps the modules, the contract and the callbacks off it
    # (test_module_and_callbacks_never_touch_compat)
    "lightning_megatron._compat": 0,
}
GROUND = {f"{TOP}.{name}" for name in ("microbatch", "options", "distributed", "atomic", "hf_io", "staged_write",
                                                "families")}
# (importer, imported, the function it may do so in): the only imports a ground-floor leaf makes upwards
GROUND_EXCEPTIONS = {(f"{TOP}.distributed", f"{TOP}._compat", "init_single_process")}

# (file, why): the files that may rename a file or folder themselves
RENAMES_ALLOWED = {
    "atomic.py": "the one stage-then-rename",
}




















def room(name: str) -> str:
    """The room a module belongs to: the package itself, a top-level module, or the top-level folder it is in."""
    return ".".join(name.split(".")[:2])


def floor(name: str) -> int:
    if room(name) not in FLOORS:
        raise KeyError(f"{name} has no floor: add its room {room(name)} to FLOORS in tests/test_structure.py and to "
                       "the README's floor table")
    return FLOORS[room(name)]


def test_import_graph_has_no_cycle() -> None:
    cycle = find_cycle(import_graph())
    assert cycle is None, "import circle (lazy and TYPE_CHECKING imports count): " + " -> ".join(cycle)


def test_find_cycle_sees_a_circle() -> None:
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_exports_name_modules_that_define_them() -> None:
    tree = syntax(PACKAGE / "__init__.py")
    table = next(node.value for node in tree.body if isinstance(node, ast.Assign)
                 and any(isinstance(target, ast.Name) and target.id == "_EXPORTS" for target in node.targets))
    exports = ast.literal_eval(table)
    problems = []
    for attribute, module in exports.items():
        if module not in modules():
            problems.append(f"_EXPORTS[{attribute!r}] = {module!r}: no such module")
        elif attribute not in top_level_names(syntax(modules()[module])):
            problems.append(f"_EXPORTS[{attribute!r}] = {module!r}: that module does not define {attribute}")
    assert not problems, "\n".join(problems)




def test_every_module_has_a_floor() -> None:
    missing = []
    for name in modules():
        try:
            floor(name)
        except KeyError as error:
            missing.append(str(error))
    assert not missing, "\n".join(missing)


def test_imports_go_to_the_same_floor_or_lower() -> None:
    violations = [f"{edge.importer} (floor {floor(edge.importer)}) imports {edge.imported} "
                  f"(floor {floor(edge.imported)}) at line {edge.line}"
                  for edge in imports() if floor(edge.imported) > floor(edge.importer)]
    assert not violations, "imports up a floor:\n" + "\n".join(violations)


def folder_overrides(floors: dict[str, int], top: str = TOP) -> list[str]:
    """The keys of `floors` that are not rooms: a module or folder inside a top-level folder given its own floor."""
    return sorted(key for key in floors if key != top and len(key.split(".")) != 2)


def test_every_folder_is_on_one_floor() -> None:
    overrides = folder_overrides(FLOORS)
    assert not overrides, ("a folder is one room on one floor; move these where their floor is, and drop their own "
                           "FLOORS entries: " + ", ".join(overrides))
    rooms = {room(name) for name in modules()}
    stale = sorted(set(FLOORS) - rooms)
    assert not stale, "FLOORS names rooms that do not exist (remove them here and in the README): " + ", ".join(stale)


def test_folder_overrides_finds_them() -> None:
    floors = {"p": 5, "p.vl": 3, "p.vl.bridge": 2, "p.strategy": 3, "p.mtp.trunk_graph.inner": 1}
    assert folder_overrides(floors, top="p") == ["p.mtp.trunk_graph.inner", "p.vl.bridge"]


# ---------------------------------------------------------------------------------------------- the README's table

README = ROOT / "README.md"
README_SECTION = "## Where things are"


def readme_floors(text: str, top: str = TOP) -> dict[str, int]:
    """The floor of every room the README's floor table names: `cli/` and `strategy.py` are rooms of `top`,
    `__init__.py` is `top` itself. Raises on a room named twice."""
    section = text.split(README_SECTION, 1)[1].split("\n## ", 1)[0]
    floors: dict[str, int] = {}
    for line in section.splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if len(cells) < 3 or not cells[0].isdigit():
            continue
        for name in re.findall(r"`([^`]+)`", cells[1]):
            key = top if name == "__init__.py" else f"{top}.{name.removesuffix('/').removesuffix('.py')}"
            if key in floors:
                raise ValueError(f"the README's floor table names {name} twice")
            floors[key] = int(cells[0])
    return floors


def floor_differences(expected: dict[str, int], found: dict[str, int]) -> list[str]:
    return [f"{name}: FLOORS says {expected.get(name, 'nothing')}, the README {found.get(name, 'nothing')}"
            for name in sorted(set(expected) | set(found)) if expected.get(name) != found.get(name)]


def test_readme_floor_table_equals_floors() -> None:
    differences = floor_differences(FLOORS, readme_floors(README.read_text(encoding="utf-8")))
    assert not differences, ("the README's floor table and FLOORS differ (FLOORS is the source of truth; change "
                             "both):\n" + "\n".join(differences))


def test_readme_floors_reads_the_table() -> None:
    text = ("# x\n## Where things are\n\n| floor | room | what |\n|---|---|---|\n"
            "| 5 | `cli/`, `__init__.py` | commands (`not_a_room`) |\n| 0 | `atomic.py` | the write |\n\n"
            "## Next\n| 2 | `elsewhere.py` | not in the section |\n")
    found = readme_floors(text, top="p")
    assert found == {"p.cli": 5, "p": 5, "p.atomic": 0}
    assert floor_differences({"p.cli": 5, "p": 4, "p.moe": 2}, found) == [
        "p: FLOORS says 4, the README 5", "p.atomic: FLOORS says nothing, the README 0",
        "p.moe: FLOORS says 2, the README nothing"]
    with pytest.raises(ValueError, match="names `?cli/`? twice"):
        readme_floors(text.replace("`atomic.py`", "`cli/`"), top="p")


# ---------------------------------------------------------------------------------------------- the contract room






def test_the_strategy_never_imports_the_file_that_defines_sft_module() -> None:
    defining = [name for name, path in modules().items() if defines_class(syntax(path), "SFTModule")]
    assert len(defining) == 1, f"expected one module defining SFTModule, found {defining}"
    strategy = f"{TOP}.strategy"
    assert defining[0] not in reachable(import_graph(), strategy), (
        f"{strategy} imports {defining[0]} (directly or through other rooms): it must reach modules only through "
        f"the contract ({TOP}.contract)")


def test_defines_class_and_reachable_find_them() -> None:
    assert defines_class(ast.parse("import x\nclass SFTModule(Base):\n    pass\n"), "SFTModule")
    assert not defines_class(ast.parse("def f():\n    class SFTModule: pass\n"), "SFTModule")
    graph = {"strategy": {"contract"}, "contract": {"bridges"}, "bridges": set(), "module": {"contract"}}
    assert reachable(graph, "strategy") == {"contract", "bridges"}
    assert "module" not in reachable(graph, "strategy") and "contract" in reachable(graph, "module")


# ---------------------------------------------------------------------------------------------- attributes by name

MEGATRON = "a Megatron-Core model, module, spec or config: the field depends on the version, the model or the stage"
LIBRARY = "an object of a bridge library (megatron-bridge, mbridge): the field depends on its version and model"
UPSTREAM = "an upstream library, asked whether it still has the defect this workaround fixes"
LOADER = "any dataloader, dataset or sampler Lightning hands over (a user's included)"
TOKENIZER = "any HF tokenizer (a slow one has no backend; a tokenizer may have no chat template)"
CLI_NAMESPACE = "a jsonargparse value: a strategy given as class_path + init_args, or as something else"
# (file under lightning_megatron/, attribute) -> why: the only attributes read by name with getattr/hasattr and a
# string. A contract between rooms is never among them: declare it (contract.py, a Protocol, a Bridge method).
NAMED_ATTRIBUTES_ALLOWED: dict[tuple[str, str], str] = {
    ("_compat/_adjustment.py", "__dict__"): "any patched target: a module, a class or an instance",
    ("_compat/grouped_experts.py", "_grouped_mm"): "torch's grouped GEMM, absent before torch 2.8",
    ("_compat/grouped_experts.py", "main_grad"): MEGATRON,  # set by Megatron DDP only
    ("_compat/grouped_experts.py", "grad_added_to_main_grad"): MEGATRON,
    **{("contract.py", name): "Lightning's private internals the step metrics' short path writes through "
       "(2.5.0-2.6.6 have them); without them every metric goes through self.log"
       for name in ("_results", "should_reset_tensors", "update_metrics")},
    ("_compat/mbridge.py", "encoder_and_decoder"): UPSTREAM,
    ("_compat/mbridge.py", "rope_theta"): UPSTREAM,
    ("_compat/peft.py", "_convert_peft_config_moe"): UPSTREAM,
    ("_compat/mtp_stage.py", "mtp_process"): MEGATRON,
    ("_compat/no_te.py", "mtp_num_layers"): MEGATRON,
    ("_compat/no_te.py", "layer_specs"): MEGATRON,
    ("_compat/vl.py", "rope_parameters"): "an HF text config: transformers 5 names it rope_parameters",
    ("_compat/vl.py", "rope_scaling"): "an HF text config: transformers 4 names it rope_scaling",
    ("_compat/vl.py", "submodules"): MEGATRON,
    ("_compat/vl.py", "vision_transformer_layer_spec"): LIBRARY,
    ("attention.py", "cp"): "Megatron-Core's process-group collection: a cp group only with context parallelism",
    ("attention.py", "__name__"): "whatever a layer spec names as core attention (Transformer Engine's or ours)",
    ("bridges/megatron_bridge.py", "moe_router_enable_expert_bias"): LIBRARY,
    ("bridges/sliced_load.py", "ddp_config"): MEGATRON,
    ("bridges/sliced_load.py", "dtype"): LIBRARY,
    ("bridges/sliced_load.py", "attention_output_gate"): MEGATRON,
    ("bridges/sliced_load.py", "head_dim"): MEGATRON,
    ("bridges/sliced_load.py", "export_weight_dtype"): LIBRARY,
    ("bridges/sliced_load.py", "is_grouped_export"): LIBRARY,
    ("callbacks/mtp_only.py", "tensor_model_parallel"): "Megatron-Core sets it on tensor-parallel parameters only",
    ("cli/megatron_cli.py", "class_path"): CLI_NAMESPACE,
    ("cli/megatron_cli.py", "init_args"): CLI_NAMESPACE,
    ("cli/vl.py", "init_args"): CLI_NAMESPACE,
    ("data/cache.py", "backend_tokenizer"): TOKENIZER,
    ("data/cache.py", "chat_template"): TOKENIZER,
    ("data/tokenize.py", "chat_template"): TOKENIZER,
    ("data/datamodule.py", "sched_getaffinity"): "os: Linux has it, macOS does not",
    ("data/datamodule.py", "value"): "Lightning hands a stage as a TrainerFn or as a string",
    ("distributed.py", "last_exc"): "sys: set only once an uncaught exception was printed",
    ("hf_io.py", "sched_getaffinity"): "os: Linux has it, macOS does not",
    ("hf_io.py", "mrope_section"): "transformers: only a multi-axis rotary embedding (Qwen3.5's) has it",
    ("hf_io.py", "staging"): "a threading.local, set by each thread's first write",
    ("lora.py", "p"): LIBRARY + " (an adapter's dropout is a Dropout, or an identity without p)",
    ("mtp/draft_capture.py", "output_layer"): MEGATRON,
    ("mtp/self_distill.py", "mtp"): MEGATRON,
    ("mtp/self_distill.py", "bias"): MEGATRON,
    ("mtp/self_distill.py", "post_process"): MEGATRON,
    ("mtp/self_distill.py", "mtp_num_layers"): MEGATRON,
    ("mtp/skip_main_head.py", "grad_fn"): "whatever the model returned: a tensor, or not",
    ("mtp/skip_main_head.py", "bias"): MEGATRON,
    ("mtp/skip_main_head.py", "post_process"): MEGATRON,
    ("mtp/skip_main_head.py", "mtp_num_layers"): MEGATRON,
    ("mtp/trunk_cache.py", "dataloader"): "the training loader: the strategy's GlobalBatches wrapper or a plain one",
    ("mtp/trunk_cache.py", "dataset"): LOADER,
    ("mtp/trunk_cache.py", "examples"): LOADER + "; SFTDataModule's rest on a tokenized cache with a key",
    ("mtp/trunk_cache.py", "key"): LOADER + "; SFTDataModule's rest on a tokenized cache with a key",
    ("mtp/trunk_cache.py", "seq_length"): LOADER,
    ("mtp/trunk_cache.py", "post_process"): MEGATRON,
    ("mtp/trunk_cache.py", "mtp_process"): MEGATRON,
    ("cuda_graphs/refusals.py", "decoder"): MEGATRON,
    ("cuda_graphs/refusals.py", "cuda_graph_impl"): MEGATRON,
    ("cuda_graphs/refusals.py", "fp4"): MEGATRON,
    ("cuda_graphs/refusals.py", "cpu_offloading"): MEGATRON,
    ("cuda_graphs/refusals.py", "fine_grained_activation_offloading"): MEGATRON,
    ("optimizer.py", "grad_norms_by_group"): "Megatron-Core's optimizer: only some kinds report norms by group",
    ("schedule.py", "__dict__"): "whatever a module keeps beside its submodules (an MoE token dispatcher)",
    ("schedule.py", "sampler"): LOADER,
    ("schedule.py", "batch_sampler"): LOADER,
    ("schedule.py", "epoch"): LOADER,
    ("schedule.py", "drop_last"): LOADER,
    ("schedule.py", "set_epoch"): LOADER,
    ("serving/protocol.py", "abort"): "a torch process group: only some backends can abort",
    ("speculative/decode.py", "layer_types"): "an HF text config: GLM-4.5's and DeepSeek-V3's declare no layer types",
    ("tree_rotary.py", "mtp_process"): MEGATRON,
    ("tree_rotary.py", "rotary_pos_emb"): MEGATRON,
    ("tree_rotary.py", "position_embedding_type"): MEGATRON,
}




def test_no_contract_is_read_by_attribute_name() -> None:
    found = {(path.relative_to(PACKAGE).as_posix(), attribute): line for path in modules().values()
             for line, attribute in attributes_by_name(syntax(path))}
    unlisted = [f"{file}:{line}: {attribute}" for (file, attribute), line in sorted(found.items())
                if (file, attribute) not in NAMED_ATTRIBUTES_ALLOWED]
    assert not unlisted, ("an attribute read by name: declare what one room calls on another (contract.py, a "
                          "Protocol, a Bridge method) and call it, or, for a third-party object whose field "
                          "may be missing, list it in NAMED_ATTRIBUTES_ALLOWED with why:\n" + "\n".join(unlisted))
    stale = sorted(f"{file}: {attribute}" for file, attribute in set(NAMED_ATTRIBUTES_ALLOWED) - set(found))
    assert not stale, "NAMED_ATTRIBUTES_ALLOWED lists lookups that are gone; remove them:\n" + "\n".join(stale)


def test_attributes_by_name_finds_them() -> None:
    tree = ast.parse("getattr(module, 'enable_mtp', False)\nx.y\nhasattr(strategy, 'export_hf')\n"
                     "getattr(obj, name)\ncallable(getattr(s, 'finish_saves', None))\nself.getattr(a, 'b')\n")
    assert attributes_by_name(tree) == [(1, "enable_mtp"), (3, "export_hf"), (5, "finish_saves")]


def test_ground_floor_imports_only_the_ground_floor() -> None:
    violations = [f"{edge.importer}:{edge.line} imports {edge.imported}" for edge in imports()
                  if edge.importer in GROUND and edge.imported not in GROUND
                  and (edge.importer, edge.imported, edge.function) not in GROUND_EXCEPTIONS]
    assert not violations, "a ground-floor leaf imports above the ground floor:\n" + "\n".join(violations)
    ground = {name: {edge.imported for edge in imports() if edge.importer == name and edge.imported in GROUND}
              for name in GROUND}
    cycle = find_cycle(ground)
    assert cycle is None, "ground-floor circle: " + " -> ".join(cycle)


def test_compat_is_a_leaf() -> None:
    inside = f"{TOP}._compat"
    violations = [f"{edge.importer}:{edge.line} imports {edge.imported}" for edge in imports()
                  if (edge.importer == inside or edge.importer.startswith(inside + "."))
                  and not (edge.imported == inside or edge.imported.startswith(inside + "."))
                  and edge.imported != f"{TOP}.families"]
    assert not violations, "_compat imports the package outside _compat (only families is allowed):\n" + "\n".join(
        violations)


def test_module_and_callbacks_never_touch_compat() -> None:
    rooms = (f"{TOP}.module", f"{TOP}.contract", f"{TOP}.vl.module", f"{TOP}.callbacks")
    violations = [f"{edge.importer}:{edge.line} imports {edge.imported}" for edge in imports()
                  if edge.importer.startswith(rooms) and edge.imported.startswith(f"{TOP}._compat")]
    assert not violations, "\n".join(violations)


def test_no_file_over_500_lines() -> None:
    """The package's rooms and the test files alike: a longer one is split by what it does."""
    files = [*modules().values(), *sorted((ROOT / "tests").rglob("*.py"))]
    counts = {str(path.relative_to(ROOT)): len(path.read_text(encoding="utf-8").splitlines()) for path in files}
    offenders = {path: count for path, count in sorted(counts.items()) if count > MAX_LINES}
    assert not offenders, f"split by what it does; over {MAX_LINES} lines: " + ", ".join(
        f"{path} ({count})" for path, count in offenders.items())




def test_no_private_name_is_imported_from_another_module() -> None:
    found = [f"{path.relative_to(ROOT)}:{line}: {name} from {module}"
             for path in [*modules().values(), *sorted((ROOT / "bench").glob("*.py"))]
             for line, module, name in private_imports(syntax(path))
             if module.startswith((TOP, "bench")) and f"{module}.{name}" not in modules()]  # a module: `_compat`
    assert not found, "a private name used by another module: make it public where it is defined:\n" + "\n".join(
        found)


def test_private_imports_finds_them() -> None:
    tree = ast.parse("from a.b import _c, d\nfrom a import __version__\nimport _e\ndef f():\n    from g import _h\n")
    assert private_imports(tree) == [(1, "a.b", "_c"), (5, "g", "_h")]


def test_tests_mirror_the_package() -> None:
    """Every folder of `tests/` is named after a folder of the package (or of `bench/`), so a room's tests are found
    where the room is."""
    rooms = {path.name for path in PACKAGE.iterdir() if (path / "__init__.py").exists()} | {"bench"}
    folders = {path.name for path in (ROOT / "tests").iterdir() if path.is_dir() and path.name != "__pycache__"}
    assert not folders - rooms, f"test folders with no package folder of that name: {sorted(folders - rooms)}"




def test_renames_only_in_atomic() -> None:
    found = [f"{path.relative_to(PACKAGE)}:{line}" for path in modules().values()
             if str(path.relative_to(PACKAGE)) not in RENAMES_ALLOWED for line in renames(syntax(path))]
    assert not found, ("stage-then-rename by hand; use lightning_megatron.atomic (write_atomically, "
                       "write_file_atomically, write_text_atomically):\n" + "\n".join(found))


def test_renames_finds_them() -> None:
    tree = ast.parse("import os, shutil\nos.replace(a, b)\nPath(a).rename(b)\nshutil.move(a, b)\n"
                     "s.replace('x', 'y')\ndataclasses.replace(o)\n")
    assert renames(tree) == [2, 3, 4]


@pytest.mark.parametrize("module", [f"{TOP}.serving", f"{TOP}.mtp.restore", f"{TOP}.cli.restore_mtp"])
def test_imports_neither_lightning_nor_megatron_core(module: str) -> None:
    probe = (f"import json, sys; import {module}; "
             "print(json.dumps(sorted(name for name in sys.modules if name in ('lightning', 'lightning.pytorch') "
             "or name == 'megatron.core' or name.startswith('megatron.core.'))))")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, env=env, cwd=ROOT,
                            timeout=300)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout.splitlines()[-1]) == [], f"import {module} imports {result.stdout.strip()}"

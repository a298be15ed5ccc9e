"""Contracts between rooms are declared, read from the package's source with `ast`: the strategy never reaches the
file that defines `SFTModule` (it knows modules through `contract.py`), and no module reads an attribute by name
(`getattr`/`hasattr` with a string) except the listed fields of third-party objects, each with why.
"""

from __future__ import annotations

import ast

from tests.test_structure import PACKAGE, TOP, import_graph, modules, syntax

# ---------------------------------------------------------------------------------------------- the contract room


def defines_class(tree: ast.Module, class_name: str) -> bool:
    return any(isinstance(node, ast.ClassDef) and node.name == class_name for node in tree.body)


def reachable(graph: dict[str, set[str]], start: str) -> set[str]:
    """Every node `start` reaches in `graph` (itself excluded unless on a circle)."""
    seen: set[str] = set()
    pending = list(graph[start])
    while pending:
        node = pending.pop()
        if node not in seen:
            seen.add(node)
            pending.extend(graph[node])
    return seen


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
    ("_compat/mbridge.py", "encoder_and_decoder"): UPSTREAM,
    ("_compat/mbridge.py", "rope_theta"): UPSTREAM,
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
    ("hf_io.py", "sched_getaffinity"): "os: Linux has it, macOS does not",
    ("hf_io.py", "staging"): "a threading.local, set by each thread's first write",
    ("lora.py", "p"): LIBRARY + " (an adapter's dropout is a Dropout, or an identity without p)",
    ("module.py", "output_layer"): MEGATRON,
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
    ("schedule.py", "sampler"): LOADER,
    ("schedule.py", "batch_sampler"): LOADER,
    ("schedule.py", "epoch"): LOADER,
    ("schedule.py", "drop_last"): LOADER,
    ("schedule.py", "set_epoch"): LOADER,
    ("serving/protocol.py", "abort"): "a torch process group: only some backends can abort",
    ("tree_rotary.py", "mtp_process"): MEGATRON,
    ("tree_rotary.py", "rotary_pos_emb"): MEGATRON,
    ("tree_rotary.py", "position_embedding_type"): MEGATRON,
}


def attributes_by_name(tree: ast.Module) -> list[tuple[int, str]]:
    """(line, attribute) of every `getattr(x, "attribute", ...)` and `hasattr(x, "attribute")`."""
    return sorted((node.lineno, node.args[1].value) for node in ast.walk(tree)
                  if isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                  and node.func.id in ("getattr", "hasattr") and len(node.args) >= 2
                  and isinstance(node.args[1], ast.Constant) and isinstance(node.args[1].value, str))


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

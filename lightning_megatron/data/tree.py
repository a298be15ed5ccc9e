"""Tree packing: sequences that share a prefix (several responses to one prompt, conversations that extend each other)
merged into a trie and laid out in one row, so every shared token runs through the model once.

The trie is *lookahead-1*: a node is keyed by (token, next token), so two sequences share a row only while their next
tokens agree too, and every row has exactly one label (the row's next token) however many sequences pass through it.
That costs one duplicated token per extra child at a branch point (and per sequence ending inside another), and it
keeps the loss Megatron's ordinary per-token cross-entropy. A row's ``loss_mask`` is the number of original sequences
that train that label, so the loss normaliser counts original tokens, as padded or THD training does.

Layout: DFS pre-order, so each subtree is one contiguous range. ``subtree_end[k]`` (exclusive) is where the subtree of
row ``k`` ends, and key ``k`` is visible to query ``q`` iff ``k <= q < subtree_end[k]``: exactly the ancestors of
``q`` and ``q`` itself. ``position_ids`` is the depth, which is the token's index in every sequence through it, so
RoPE must read it (see ``lightning_megatron.tree_positions``). Padding attends only to itself
(``subtree_end = own index + 1``) with depth 0 and weight 0. Tries are first-fit, in file order, into rows of
``seq_length`` tree tokens; a trie never straddles rows, so sequences sharing a prefix stay together.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch.utils.data import Dataset

from lightning_megatron.data.packing import first_fit
from lightning_megatron.data.tokenize import TokenizedExample
from lightning_megatron.microbatch import SUBTREE_END

_END = -1  # the "next token" of a sequence's last token: it has no label


@dataclass
class _Node:
    token: int
    label: int  # the next token; _END at the end of a sequence
    weight: int = 0  # sequences that train this label
    children: dict[tuple[int, int], _Node] = field(default_factory=dict)


def _keys(example: TokenizedExample) -> list[tuple[int, int]]:
    ids = example.input_ids.tolist()
    return list(zip(ids, ids[1:] + [_END]))


class _Trie:
    """One lookahead-1 trie (its sequences share their first two tokens) and the examples inserted into it, in order."""

    def __init__(self) -> None:
        self.root = _Node(token=_END, label=_END)
        self.size = 0  # nodes, i.e. tree tokens
        self.members: list[int] = []

    def new_nodes(self, keys: list[tuple[int, int]]) -> int:
        """How many nodes inserting a sequence with these keys would add."""
        node = self.root
        for depth, key in enumerate(keys):
            child = node.children.get(key)
            if child is None:
                return len(keys) - depth
            node = child
        return 0

    def insert(self, index: int, keys: list[tuple[int, int]], trained: list[bool]) -> None:
        """Add sequence ``index``; ``trained[t]`` says whether its label at ``t`` (token ``t + 1``) is trained."""
        node = self.root
        for key, is_trained in zip(keys, trained):
            child = node.children.get(key)
            if child is None:
                child = node.children[key] = _Node(token=key[0], label=key[1])
                self.size += 1
            child.weight += int(is_trained)
            node = child
        self.members.append(index)

    def layout(self) -> tuple[list[int], list[int], list[int], list[int], list[int], dict[int, int]]:
        """DFS pre-order ``(ids, labels, weights, depths, subtree_ends)`` and the row of each node (by ``id``).

        Iterative, because a path can be longer than Python's recursion limit.
        """
        ids: list[int] = []
        labels: list[int] = []
        weights: list[int] = []
        depths: list[int] = []
        ends: list[int] = [0] * self.size
        row_of: dict[int, int] = {}
        stack: list[tuple[_Node, int, bool]] = [(child, 0, False) for child in reversed(self.root.children.values())]
        while stack:
            node, depth, closing = stack.pop()
            if closing:
                ends[row_of[id(node)]] = len(ids)
                continue
            row_of[id(node)] = len(ids)
            ids.append(node.token)
            labels.append(node.label)
            weights.append(node.weight)
            depths.append(depth)
            stack.append((node, depth, True))
            stack.extend((child, depth + 1, False) for child in reversed(node.children.values()))
        return ids, labels, weights, depths, ends, row_of

    def path_rows(self, keys: list[tuple[int, int]], row_of: dict[int, int]) -> list[int]:
        node, rows = self.root, []
        for key in keys:
            node = node.children[key]
            rows.append(row_of[id(node)])
        return rows


@dataclass(frozen=True)
class TreePacking:
    """Rows of tree-packed sequences and where each original sequence lies in them.

    ``rows[i]`` holds ``input_ids``, ``labels``, ``loss_mask`` (float32 integer counts), ``position_ids`` (depth)
    and ``subtree_end`` (int64), each ``[seq_length]``. ``paths[j] = (row, positions)``: sequence ``j``'s token ``t``
    is at ``rows[row][..][positions[t]]``. ``tree_tokens`` counts non-padding row tokens, ``original_tokens`` the
    tokens of the sequences; their ratio (``tree_token_ratio``) is the share of the flat work left.
    """

    rows: list[dict[str, torch.Tensor]]
    paths: list[tuple[int, torch.Tensor]]
    tree_tokens: int
    original_tokens: int

    @property
    def tree_token_ratio(self) -> float:
        return self.tree_tokens / max(1, self.original_tokens)


def build_tree_rows(examples: Sequence[TokenizedExample], seq_length: int, pad_id: int) -> TreePacking:
    """Merge ``examples`` into lookahead-1 tries of at most ``seq_length`` tokens and first-fit them into rows.

    Sequences are inserted in order into the open trie of their first two tokens (the key of their root); a
    sequence whose new nodes would overflow ``seq_length`` closes that trie and starts the next one. Deterministic:
    the same examples in the same order give the same rows.
    """
    tries: list[_Trie] = []
    open_trie: dict[tuple[int, int], _Trie] = {}
    all_keys = [_keys(example) for example in examples]
    for index, (example, keys) in enumerate(zip(examples, all_keys)):
        if len(keys) > seq_length:
            raise ValueError(f"{example.source}: {len(keys)} tokens do not fit seq_length={seq_length}")
        if not keys:
            raise ValueError(f"{example.source}: an empty sequence cannot be tree-packed")
        trie = open_trie.get(keys[0])
        if trie is None or trie.size + trie.new_nodes(keys) > seq_length:
            trie = open_trie[keys[0]] = _Trie()
            tries.append(trie)
        trained = example.response_mask[1:].tolist() + [False]
        trie.insert(index, keys, trained)

    rows: list[dict[str, torch.Tensor]] = []
    paths: dict[int, tuple[int, torch.Tensor]] = {}
    for row_index, members in enumerate(first_fit([trie.size for trie in tries], seq_length)):
        row = _empty_tree_row(seq_length, pad_id)
        start = 0
        for trie in (tries[i] for i in members):
            ids, labels, weights, depths, ends, row_of = trie.layout()
            span = slice(start, start + trie.size)
            row["input_ids"][span] = torch.tensor(ids)
            row["labels"][span] = torch.tensor([pad_id if label == _END else label for label in labels])
            row["loss_mask"][span] = torch.tensor(weights, dtype=torch.float32)
            row["position_ids"][span] = torch.tensor(depths)
            row[SUBTREE_END][span] = torch.tensor(ends) + start
            for member in trie.members:
                positions = torch.tensor(trie.path_rows(all_keys[member], row_of)) + start
                paths[member] = (row_index, positions)
            start += trie.size
        rows.append(row)
    tree_tokens = sum(trie.size for trie in tries)
    original_tokens = sum(len(example) for example in examples)
    return TreePacking(rows, [paths[index] for index in range(len(examples))], tree_tokens, original_tokens)


def _empty_tree_row(seq_length: int, pad_id: int) -> dict[str, torch.Tensor]:
    """All padding: pad ids with the pad id as label, weight 0, depth 0, each attending only to itself."""
    return {
        "input_ids": torch.full((seq_length,), pad_id, dtype=torch.int64),
        "labels": torch.full((seq_length,), pad_id, dtype=torch.int64),
        "loss_mask": torch.zeros(seq_length, dtype=torch.float32),
        "position_ids": torch.zeros(seq_length, dtype=torch.int64),
        SUBTREE_END: torch.arange(1, seq_length + 1, dtype=torch.int64),
    }


class TreeSFTDataset(Dataset):
    """Tree-packed rows of ``seq_length`` tokens (:func:`build_tree_rows`, built once); one row per micro-batch."""

    def __init__(self, examples: list[TokenizedExample], seq_length: int, pad_id: int) -> None:
        self.packing = build_tree_rows(examples, seq_length, pad_id)

    @property
    def tree_token_ratio(self) -> float:
        return self.packing.tree_token_ratio

    def __len__(self) -> int:
        return len(self.packing.rows)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return self.packing.rows[index]


def collate_tree(samples: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """A tree micro-batch is one row: ``[1, s]`` tensors."""
    if len(samples) != 1:
        raise ValueError(f"a tree-packed micro-batch holds one row, got {len(samples)}: use micro_batch_size=1 "
                         "and raise seq_length to put more sequences in a row")
    return {key: value.unsqueeze(0) for key, value in samples[0].items()}

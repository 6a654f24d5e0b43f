"""A sweep recipe: which tensors to swap to which quant types, in which groups, and what to leave.

```yaml
quants: [q4_0, q8_0, iq4_ks]      # default targets of every rule without its own (any case)
tensors:                          # one round per matching tensor and target
  - match: '^blk\\.\\d+\\.attn_q\\.weight$'
  - match: '^blk\\.\\d+\\.ffn_down\\.weight$'
    quants: [q4_0]
groups:                           # one round per group and target, all members at once
  - name: all_ffn_up              # its column in the CSVs (default: groupN, as the Tool Suite)
    match: ['^blk\\.\\d+\\.ffn_up\\.weight$']
locked: ['^token_embd\\.weight$'] # never swapped, whatever matches it
```

Regexes are Python's, searched (``re.search``) in the tensor name. A tensor in a group is not
also swapped alone. Type names are any type of the project's table, mainline's or ik_llama.cpp's,
in any case (:mod:`.qtypes`). :func:`plan_rounds` turns a recipe and the model's tensor names
into rounds.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import yaml

from ggufswap.shards.ggml_types import GGMLType
from ggufswap.sweep.errors import RecipeError
from ggufswap.sweep.qtypes import parse_qtype, qtype_name

_TOP_KEYS: Final = frozenset({"quants", "tensors", "groups", "locked"})
_RULE_KEYS: Final = frozenset({"match", "quants"})
_GROUP_KEYS: Final = frozenset({"name", "match", "quants"})


@dataclass(frozen=True, slots=True)
class Rule:
    patterns: tuple[re.Pattern[str], ...]
    quants: tuple[GGMLType, ...]
    group: str | None = None  # the group's column name; None: each tensor alone
    group_index: int | None = None  # its position among the recipe's groups (the Suite's N)


@dataclass(frozen=True, slots=True)
class Recipe:
    rules: tuple[Rule, ...]
    locked: tuple[re.Pattern[str], ...]
    source: str = "<recipe>"

    @property
    def targets(self) -> frozenset[GGMLType]:
        """Every type a rule of the recipe sweeps to."""
        return frozenset(q for rule in self.rules for q in rule.quants)

    @classmethod
    def load(cls, path: str | Path) -> Recipe:
        path = Path(path)
        try:
            doc = yaml.safe_load(path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, yaml.YAMLError) as exc:
            raise RecipeError(f"{path}: cannot read the recipe: {exc}") from None
        return cls.from_document(doc, source=str(path))

    @classmethod
    def from_document(cls, doc: Any, *, source: str = "<recipe>") -> Recipe:
        problems: list[str] = []
        if not isinstance(doc, Mapping):
            raise RecipeError(f"{source}: a recipe is a mapping with {sorted(_TOP_KEYS)}")
        for key in sorted(set(doc) - _TOP_KEYS):
            problems.append(f"unknown key {key!r} (known: {', '.join(sorted(_TOP_KEYS))})")
        default = _quants(doc.get("quants", []), "quants", problems)
        rules: list[Rule] = []
        for i, item in enumerate(_list(doc.get("tensors", []), "tensors", problems)):
            where = f"tensors[{i}]"
            if not isinstance(item, Mapping) or "match" not in item:
                problems.append(f"{where}: expected a mapping with 'match' (and 'quants')")
                continue
            _unknown(item, _RULE_KEYS, where, problems)
            patterns = _patterns([item["match"]], f"{where}.match", problems)
            quants = _quants(item.get("quants", default), f"{where}.quants", problems)
            rules.append(Rule(patterns, quants or default))
        for i, item in enumerate(_list(doc.get("groups", []), "groups", problems)):
            where = f"groups[{i}]"
            if not isinstance(item, Mapping) or "match" not in item:
                problems.append(f"{where}: expected a mapping with 'match' (a list of regexes)")
                continue
            _unknown(item, _GROUP_KEYS, where, problems)
            matches = item["match"] if isinstance(item["match"], list) else [item["match"]]
            patterns = _patterns(matches, f"{where}.match", problems)
            quants = _quants(item.get("quants", default), f"{where}.quants", problems)
            name = str(item.get("name") or f"group{i}")
            rules.append(Rule(patterns, quants or default, group=name, group_index=i))
        locked = _patterns(_list(doc.get("locked", []), "locked", problems), "locked", problems)
        for rule in rules:
            if not rule.quants:
                problems.append(
                    f"rule {[p.pattern for p in rule.patterns]} has no quant types "
                    "(give 'quants' in it or at the top)"
                )
        names = [r.group for r in rules if r.group is not None]
        for dup in sorted({n for n in names if names.count(n) > 1}):
            problems.append(f"group name {dup!r} is used twice")
        if not rules:
            problems.append("no 'tensors' or 'groups' rules: nothing to sweep")
        if problems:
            raise RecipeError(f"{source}: invalid recipe:\n  " + "\n  ".join(problems))
        return cls(tuple(rules), locked, source)

    def is_locked(self, name: str) -> bool:
        return any(p.search(name) for p in self.locked)


def _list(value: Any, where: str, problems: list[str]) -> list[Any]:
    if isinstance(value, list):
        return value
    problems.append(f"{where}: expected a list, found {type(value).__name__}")
    return []


def _unknown(item: Mapping[str, Any], known: frozenset[str], where: str, out: list[str]) -> None:
    for key in sorted(set(item) - known):
        out.append(f"{where}: unknown key {key!r} (known: {', '.join(sorted(known))})")


def _patterns(items: Iterable[Any], where: str, problems: list[str]) -> tuple[re.Pattern[str], ...]:
    out = []
    for item in items:
        try:
            out.append(re.compile(str(item)))
        except re.error as exc:
            problems.append(f"{where}: bad regex {item!r}: {exc}")
    return tuple(out)


def _quants(value: Any, where: str, problems: list[str]) -> tuple[GGMLType, ...]:
    items = value if isinstance(value, (list, tuple)) else [value]
    out = []
    for item in items:
        try:
            out.append(parse_qtype(int(item) if isinstance(item, int) else str(item)))
        except ValueError as exc:
            problems.append(f"{where}: {exc}")
    return tuple(out)


@dataclass(frozen=True, slots=True)
class Round:
    """One measurement: ``tensors`` swapped to ``target`` together; ``unit`` is the CSV column
    (the tensor's name, or the group's)."""

    unit: str
    tensors: tuple[str, ...]
    target: GGMLType
    group_index: int | None = None  # the Tool Suite's groupN of a group's round

    @property
    def key(self) -> str:
        """Identifies the round in the journal."""
        return f"{self.unit}@{qtype_name(self.target)}"


@dataclass(frozen=True, slots=True)
class Skip:
    """A tensor or round left out, and why. ``equivalent``: the target types for which the unit
    is recorded as baseline-equivalent (KLD 0, the baseline's PPL), as the Tool Suite records a
    tensor the model ignores: swapping it cannot change the logits (unused, or already that
    type); empty for locked tensors (not part of the sweep)."""

    unit: str
    target: str
    reason: str
    equivalent: tuple[str, ...] = ()


UNUSED: Final = "the model never computes with it"


def plan_rounds(
    recipe: Recipe,
    names: Iterable[str],
    *,
    computed: frozenset[str],
    types: Mapping[str, int],  # each tensor's GGML type code
) -> tuple[list[Round], list[Skip]]:
    """The rounds of ``recipe`` over the model's tensor ``names`` (in model order), and what is
    skipped: locked tensors, tensors the model never computes with (not in ``computed``), and
    rounds whose every tensor already has the target type (the last two baseline-equivalent)."""
    ordered = list(names)
    rounds: list[Round] = []
    skips: list[Skip] = []
    grouped: set[str] = set()
    for group in (r for r in recipe.rules if r.group is not None):
        assert group.group is not None, "filtered on groups"
        members = [n for n in ordered if _matches(group, n)]
        grouped.update(members)
        kept = [n for n in members if not recipe.is_locked(n) and n in computed]
        for name in members:
            if recipe.is_locked(name):
                skips.append(Skip(name, "*", f"locked (group {group.group} goes without it)"))
            elif name not in computed:
                skips.append(Skip(name, "*", f"{UNUSED} (group {group.group} goes without it)"))
        if not kept:
            why = "no swappable tensor matches the group"
            unused = any(n not in computed and not recipe.is_locked(n) for n in members)
            equivalent = tuple(qtype_name(q) for q in group.quants) if unused else ()
            skips.append(Skip(group.group, "*", why, equivalent))
            continue
        for q in group.quants:
            if all(types.get(n) == q for n in kept):
                name = qtype_name(q)
                skips.append(Skip(group.group, name, f"every member is already {name}", (name,)))
            else:
                rounds.append(Round(group.group, tuple(kept), q, group.group_index))
    seen: set[str] = set()
    for name in ordered:
        if name in grouped:
            continue
        rule = next((r for r in recipe.rules if r.group is None and _matches(r, name)), None)
        if rule is None or name in seen:
            continue
        seen.add(name)
        if recipe.is_locked(name):
            skips.append(Skip(name, "*", "locked"))
            continue
        if name not in computed:
            skips.append(Skip(name, "*", UNUSED, tuple(qtype_name(q) for q in rule.quants)))
            continue
        for q in rule.quants:
            if types.get(name) == q:
                skips.append(
                    Skip(name, qtype_name(q), f"already {qtype_name(q)}", (qtype_name(q),))
                )
            else:
                rounds.append(Round(name, (name,), q))
    return rounds, skips


def _matches(rule: Rule, name: str) -> bool:
    return any(p.search(name) for p in rule.patterns)

"""Typed reading of a composed YAML node tree, collecting every problem with its line.

The file is composed with PyYAML's ``SafeLoader`` (never constructed as a whole), so every value
keeps its position. Scalars are constructed one at a time, only for the standard safe tags;
anything else (``!!python/object``, local tags, ``!!binary``, ``!!set``) is refused.
"""

from __future__ import annotations

import difflib
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from typing import TypeVar

import yaml
from yaml.nodes import MappingNode, Node, ScalarNode, SequenceNode

from ggufswap.config.errors import ConfigProblem, Invalid

T = TypeVar("T")

# A converter turns one node into a value or raises ``Invalid``; the string is its key path.
Converter = Callable[[Node, str], T]

MAX_FILE_BYTES = 4 * 1024 * 1024  # a configuration is a few kilobytes; refuse anything absurd


class Tags:
    """The YAML 1.1 tags that ``SafeLoader`` resolves and that a configuration may use."""

    PREFIX = "tag:yaml.org,2002:"
    NULL = PREFIX + "null"
    BOOL = PREFIX + "bool"
    INT = PREFIX + "int"
    FLOAT = PREFIX + "float"
    STR = PREFIX + "str"
    TIMESTAMP = PREFIX + "timestamp"  # kept as its text: an unquoted date in a name is a string
    SEQ = PREFIX + "seq"
    MAP = PREFIX + "map"
    MERGE = PREFIX + "merge"  # ``<<: *anchor``
    PYTHON = PREFIX + "python/"


_SCALAR_TAGS = frozenset({Tags.NULL, Tags.BOOL, Tags.INT, Tags.FLOAT, Tags.STR, Tags.TIMESTAMP})
_KIND_NAMES = {
    Tags.NULL: "null",
    Tags.BOOL: "a boolean",
    Tags.INT: "an integer",
    Tags.FLOAT: "a number",
    Tags.STR: "a string",
    Tags.TIMESTAMP: "a date",
}


def short_tag(tag: str) -> str:
    """``tag:yaml.org,2002:python/object`` as a user writes it: ``!!python/object``."""
    return "!!" + tag.removeprefix(Tags.PREFIX) if tag.startswith(Tags.PREFIX) else tag


def line_of(node: Node) -> int:
    """1-based line where ``node`` starts."""
    return int(node.start_mark.line) + 1


@dataclass(slots=True)
class Section:
    """A mapping that has been checked against its known keys."""

    path: str
    node: Node
    values: dict[str, Node] = field(default_factory=dict)

    def child(self, key: str) -> str:
        return f"{self.path}.{key}" if self.path else key


def item_path(path: str, index: int) -> str:
    return f"{path}[{index}]"


class NodeReader:
    """Converts nodes into values and records every problem, in file order, with its line."""

    def __init__(self, *, file: str):
        self.file = file
        self.problems: list[ConfigProblem] = []
        self.lines: dict[str, int] = {}  # key path -> line of its value, for later cross-checks
        self._refused: set[int] = set()  # ids of nodes whose tag was already reported
        self._constructor = yaml.constructor.SafeConstructor()

    # --- parsing -------------------------------------------------------------------------

    def compose(self, text: str | bytes) -> Node | None:
        """The document's root node, or ``None`` for an empty file or a syntax error."""
        if len(text) > MAX_FILE_BYTES:
            self.report(None, "", f"file is {len(text)} bytes; at most {MAX_FILE_BYTES} allowed")
            return None
        try:
            root: Node | None = yaml.compose(text, Loader=yaml.SafeLoader)
        except yaml.MarkedYAMLError as exc:
            mark = exc.problem_mark or exc.context_mark
            line = None if mark is None else int(mark.line) + 1
            what = " ".join(str(x) for x in (exc.context, exc.problem) if x)
            self.problems.append(ConfigProblem(self.file, line, "", f"YAML syntax: {what}"))
            return None
        except yaml.reader.ReaderError as exc:  # bad encoding, control characters
            head = text[: exc.position]
            line = (head.count("\n") if isinstance(head, str) else head.count(b"\n")) + 1
            what = str(exc).splitlines()[0]
            self.problems.append(
                ConfigProblem(self.file, line, "", f"not readable as YAML: {what}")
            )
            return None
        except yaml.YAMLError as exc:
            self.report(None, "", f"not readable as YAML: {str(exc).splitlines()[0]}")
            return None
        except RecursionError:
            self.report(None, "", "YAML nesting is too deep")
            return None
        if root is not None:
            self._refuse_unknown_tags(root)
        return root

    def _refuse_unknown_tags(self, root: Node) -> None:
        """Report every node with a tag outside the safe set, wherever it is (aliases included)."""
        seen: set[int] = set()
        stack = [root]
        while stack:
            node = stack.pop()
            if id(node) in seen:
                continue
            seen.add(id(node))
            tag = node.tag
            if isinstance(node, MappingNode):
                ok = tag == Tags.MAP
                for key, value in node.value:
                    stack.extend((value, key))
            elif isinstance(node, SequenceNode):
                ok = tag == Tags.SEQ
                stack.extend(reversed(node.value))
            else:
                ok = tag in _SCALAR_TAGS or tag == Tags.MERGE
            if ok:
                continue
            self._refused.add(id(node))
            if tag.startswith(Tags.PYTHON):
                why = f"unsafe YAML tag {short_tag(tag)!r} refused: only plain YAML is accepted"
            else:
                why = f"unsupported YAML tag {short_tag(tag)!r}: only plain YAML is accepted"
            self.report(node, "", why)
        self.problems.sort(key=lambda p: p.line or 0)

    # --- problems ------------------------------------------------------------------------

    def report(self, node: Node | None, key_path: str, message: str) -> None:
        line = None if node is None else line_of(node)
        self.problems.append(ConfigProblem(self.file, line, key_path, message))

    def report_at(self, key_path: str, message: str, *, fallback: Node | None = None) -> None:
        """Report at the line recorded for ``key_path`` (or ``fallback``'s line)."""
        line = self.lines.get(key_path)
        if line is None and fallback is not None:
            line = line_of(fallback)
        self.problems.append(ConfigProblem(self.file, line, key_path, message))

    def has_problem_under(self, key_path: str) -> bool:
        return any(
            p.key_path == key_path or p.key_path.startswith((key_path + ".", key_path + "["))
            for p in self.problems
        )

    # --- structure -----------------------------------------------------------------------

    def section(
        self,
        node: Node | None,
        path: str,
        *,
        keys: Collection[str],
        required: Collection[str] = (),
        parent: Node | None = None,
    ) -> Section:
        """Check a mapping: keys are strings, known and unique; required keys are present.

        ``None`` (or an explicit YAML null) is an empty mapping. Raises ``Invalid`` when the node
        is not a mapping at all.
        """
        anchor = node if node is not None else parent
        assert anchor is not None, f"{path}: a section needs its node or its parent"
        section = Section(path, anchor)
        if node is not None and not self.is_null(node):
            if not isinstance(node, MappingNode):
                raise Invalid(f"expected a mapping of keys, found {self.describe(node)}")
            self._collect(node, section, keys, seen_merges=set())
        for key in required:
            value = section.values.get(key)
            if value is None:
                self.report(anchor, section.child(key), f"missing required key '{key}'")
            elif self.is_null(value):
                self.report(value, section.child(key), f"'{key}' needs a value")
        return section

    def _collect(
        self, node: MappingNode, section: Section, keys: Collection[str], seen_merges: set[int]
    ) -> None:
        merged: list[Node] = []
        for key_node, value in node.value:
            if key_node.tag == Tags.MERGE:
                merged.append(value)
                continue
            if not isinstance(key_node, ScalarNode) or key_node.tag != Tags.STR:
                what = self.describe(key_node)
                self.fail(key_node, section.path, f"keys must be plain strings, found {what}")
                continue
            key = str(key_node.value)
            if key in section.values:
                first = line_of(section.values[key])
                self.report(
                    key_node, section.child(key), f"duplicate key '{key}' (first at line {first})"
                )
                continue
            if key not in keys:
                self.report(key_node, section.child(key), self._unknown_key(key, keys))
                continue
            section.values[key] = value
        # Merged keys (``<<: *defaults``) rank below the mapping's own keys.
        for value in merged:
            sources = value.value if isinstance(value, SequenceNode) else [value]
            for source in sources:
                if id(source) in seen_merges:
                    continue
                seen_merges.add(id(source))
                if not isinstance(source, MappingNode):
                    what = self.describe(source)
                    self.fail(source, section.path, f"'<<' merges a mapping, found {what}")
                    continue
                inner = Section(section.path, source)
                self._collect(source, inner, keys, seen_merges)
                for key, merged_value in inner.values.items():
                    section.values.setdefault(key, merged_value)

    @staticmethod
    def _unknown_key(key: str, keys: Collection[str]) -> str:
        close = difflib.get_close_matches(key, sorted(keys), n=1, cutoff=0.6)
        if close:
            return f"unknown key '{key}'; did you mean '{close[0]}'?"
        return f"unknown key '{key}'; expected one of: {', '.join(sorted(keys))}"

    # --- values --------------------------------------------------------------------------

    def get(self, section: Section, key: str, convert: Converter[T], default: T) -> T:
        """The converted value of ``key``; ``default`` when absent, null or invalid."""
        node = section.values.get(key)
        if node is None or self.is_null(node):
            return default
        return self.convert(node, section.child(key), convert, default)

    def convert(self, node: Node, path: str, convert: Converter[T], default: T) -> T:
        """``convert(node)``, or ``default`` after recording the problem."""
        self.lines[path] = line_of(node)
        try:
            return convert(node, path)
        except Invalid as exc:
            self.fail(exc.node or node, path, exc.message)
            return default

    def items(self, node: Node, path: str, convert: Converter[T]) -> list[T]:
        """Each valid item of a list (a null is an empty list); every bad item is reported."""
        if self.is_null(node):
            return []
        if not isinstance(node, SequenceNode):
            raise Invalid(f"expected a list, found {self.describe(node)}")
        out: list[T] = []
        for index, item in enumerate(node.value):
            path_i = item_path(path, index)
            self.lines[path_i] = line_of(item)
            try:
                out.append(convert(item, path_i))
            except Invalid as exc:
                self.fail(exc.node or item, path_i, exc.message)
        return out

    def fail(self, node: Node, path: str, message: str) -> None:
        """Record a problem, unless the node's tag was already refused."""
        if id(node) not in self._refused:
            self.report(node, path, message)

    def scalar(self, node: Node) -> object:
        """The Python value of a scalar node with a safe tag."""
        if id(node) in self._refused:
            raise Invalid("refused tag", node)
        if not isinstance(node, ScalarNode):
            raise Invalid(f"expected a single value, found {self.describe(node)}")
        if node.tag == Tags.TIMESTAMP:
            return str(node.value)
        try:
            return self._constructor.construct_object(node)
        except (yaml.YAMLError, ValueError, TypeError, OverflowError) as exc:
            tag = short_tag(node.tag)
            raise Invalid(f"{tag} value {node.value!r} is malformed: {exc}") from None

    def is_null(self, node: Node) -> bool:
        return isinstance(node, ScalarNode) and node.tag == Tags.NULL

    def describe(self, node: Node) -> str:
        """What a node is, for 'expected X, found Y' messages."""
        if isinstance(node, MappingNode):
            return "a mapping"
        if isinstance(node, SequenceNode):
            return "a list"
        if node.tag == Tags.STR:
            return repr(node.value)
        kind = _KIND_NAMES.get(node.tag, short_tag(node.tag))
        return f"{kind} {node.value!r}" if node.tag != Tags.NULL else "null"

"""Bounds on a structured-output spec, checked in Python before any native code sees it (issue 59).

llguidance compiles a grammar by native recursion, so a long chain of JSON-schema ``$ref`` links or of
grammar rules overflows its stack (a segfault that no exception catches), and its lexer can spend seconds
and hundreds of megabytes on one short regex. :class:`GrammarLimits` holds every bound in one place:

- the spec's size in UTF-8 bytes, its schema depth (the longest path through nested subschemas and
  ``$ref`` links, cycles cut), its rule depth (the longest chain of Lark/GBNF rule references);
- llguidance's own per-matcher limits (lexer fuel per mask, lexer states, grammar symbols);
- the sandbox's time and memory budget per new spec (:mod:`specdecode.grammar_worker`);
- the compiled-grammar cache's size, in entries and in (estimated) bytes.

The defaults keep each chain at a fraction of what crashes llguidance 1.9.1 in the sandbox's 2 MiB
stack (docs/server.md lists them with what they stop). Exceeding one is a :class:`BoundExceeded`
naming it.
"""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass, field
from typing import Any

from specdecode.extras import MissingExtra

try:
    from llguidance.gbnf_to_lark import is_lark_syntax
except ModuleNotFoundError as exc:  # structured outputs are an extra
    raise MissingExtra("llguidance", "structured", "structured outputs") from exc


class BoundExceeded(ValueError):
    """A spec over one of :class:`GrammarLimits`' bounds; the message names it."""


@dataclass(frozen=True)
class ParserLimits:
    """llguidance's per-matcher limits (``llguidance.LLParserLimits``); a mask that would exceed one puts
    the matcher in an error state instead (a 400 at validation, else the output ends)."""

    step_lexer_fuel: int = 50_000  # lexer work per mask (llguidance's default: 200,000)
    initial_lexer_fuel: int = 200_000  # building the lexer's regexes (default 1,000,000)
    max_lexer_states: int = 20_000  # lexer states a matcher may build, ~1-2 kB each (default 250,000)
    max_grammar_size: int = 200_000  # symbols in the grammar's productions (default 500,000)
    step_max_items: int = 50_000  # Earley items per mask (llguidance's default)


@dataclass(frozen=True)
class GrammarLimits:
    max_grammar_bytes: int = 128 << 10  # a schema, regex or grammar's text, UTF-8
    max_schema_depth: int = 64  # nested subschemas + $ref links along one path (cycles cut)
    max_rule_depth: int = 128  # rule references along one path of a Lark/GBNF grammar (cycles cut)
    parser: ParserLimits = field(default_factory=ParserLimits)
    time_budget_s: float = 2.0  # the sandbox's compile + first mask of a new spec, CPU seconds of its child
    wall_limit_s: float = 60.0  # the same in wall-clock time: stops a child that neither answers nor computes
    memory_budget_bytes: int = 1 << 30  # the sandbox's address space for one spec, above its resting size
    max_matcher_bytes: int = 16 << 20  # one compiled matcher after its first mask (estimated from the heap)
    cache_entries: int = 64  # compiled specs kept (LRU)
    cache_bytes: int = 256 << 20  # their estimated bytes, ready matchers included
    ready_per_spec: int = 16  # matchers compiled ahead per spec, off the engine thread

    def parser_dict(self) -> dict[str, Any]:
        return asdict(self.parser)


# --- JSON schemas ---------------------------------------------------------------------------------------


def _pointer(root: Any, ref: str) -> Any:
    """The subschema a local ``$ref`` ("#", "#/$defs/a", "#/properties/x/items") names; None if none."""
    if ref == "#":
        return root
    if not ref.startswith("#/"):
        return None
    node = root
    for part in ref[2:].split("/"):
        part = part.replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return None
    return node


def schema_depth(schema: Any) -> int:
    """The longest path through nested schema objects and local ``$ref`` links, each object counted once
    per path (a link back to an object on the path is recursion, cut). Iterative: any depth is safe."""
    if not isinstance(schema, (dict, list)):
        return 0  # true, false
    memo: dict[int, int] = {}
    on_path: set[int] = set()
    stack: list[tuple[Any, list[Any] | None]] = [(schema, None)]
    keep: list[Any] = []  # nodes stay alive while their ids are memo keys
    while stack:
        node, children = stack[-1]
        if children is None:
            if id(node) in memo:
                stack.pop()
                continue
            on_path.add(id(node))
            keep.append(node)
            kids = list(node.values()) if isinstance(node, dict) else list(node)
            ref = node.get("$ref") if isinstance(node, dict) else None
            if isinstance(ref, str):
                target = _pointer(schema, ref)
                if target is not None:
                    kids.append(target)
            kids = [k for k in kids if isinstance(k, (dict, list)) and id(k) not in on_path]
            stack[-1] = (node, kids)
            stack.extend((k, None) for k in kids if id(k) not in memo)
            continue
        stack.pop()
        on_path.discard(id(node))
        below = max((memo.get(id(k), 0) for k in children), default=0)
        memo[id(node)] = below + (1 if isinstance(node, dict) else 0)
    return memo.get(id(schema), 0)


# --- Lark / GBNF grammars -------------------------------------------------------------------------------

_SKIP = re.compile(
    r'''
    "(?:[^"\\\n]|\\.)*"i?            # a string
  | '(?:[^'\\\n]|\\.)*'i?            # a string, single quotes
  | /(?![/*])(?:[^/\\\n]|\\.)+/[imsxlu]*   # a Lark regex
  | //[^\n]*                         # a Lark comment
  | <[^<>\n]*>                       # a special token: <[12]>, <|end|>
''',
    re.VERBOSE,
)
_GBNF_SKIP = re.compile(r'"(?:[^"\\\n]|\\.)*"|\[(?:[^\]\\\n]|\\.)*\]|#[^\n]*')
_LARK_DEF = re.compile(r"^[ \t]*[?!]?([A-Za-z_][A-Za-z0-9_]*)(?:\.-?\d+)?[ \t]*:(?!:)", re.MULTILINE)
_GBNF_DEF = re.compile(r"^[ \t]*([A-Za-z0-9_-]+)[ \t]*::=", re.MULTILINE)
_LARK_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_GBNF_NAME = re.compile(r"[A-Za-z0-9_-]+")


def _json_objects(text: str) -> list[Any]:
    """The inline JSON schemas of a Lark grammar (``%json { ... }``)."""
    out, decoder = [], json.JSONDecoder()
    for m in re.finditer(r"%json\s*(?=\{)", text):
        try:
            out.append(decoder.raw_decode(text, m.end())[0])
        except (ValueError, RecursionError):
            pass  # llguidance reports it
    return out


def rule_graph(text: str) -> tuple[dict[str, set[str]], str]:
    """(rule -> the rules its body names, the start rule) of a Lark or GBNF grammar (told apart as
    llguidance does: Lark has a ``start:`` or ``%llguidance`` line). Strings, regexes, character classes, special tokens and comments
    are skipped; ``%`` directives are not rules."""
    gbnf = not is_lark_syntax(text)
    blank = (_GBNF_SKIP if gbnf else _SKIP).sub(lambda m: " " * len(m.group()), text)
    blank = re.sub(r"(?m)^[ \t]*%[^\n]*", lambda m: " " * len(m.group()), blank)
    defs = list((_GBNF_DEF if gbnf else _LARK_DEF).finditer(blank))
    names = {m.group(1) for m in defs}
    graph: dict[str, set[str]] = {name: set() for name in names}
    name_re = _GBNF_NAME if gbnf else _LARK_NAME
    for i, m in enumerate(defs):
        body = blank[m.end() : defs[i + 1].start() if i + 1 < len(defs) else len(blank)]
        graph[m.group(1)] |= {n for n in name_re.findall(body) if n in names}
    return graph, "root" if gbnf else "start"


def rule_depth(graph: dict[str, set[str]], start: str) -> int:
    """The longest chain of rule references from ``start`` (every rule if it is not defined), each rule
    once per chain (recursion cut). Iterative."""
    memo: dict[str, int] = {}
    for root in [start] if start in graph else sorted(graph):
        on_path: set[str] = set()
        stack: list[tuple[str, list[str] | None]] = [(root, None)]
        while stack:
            name, kids = stack[-1]
            if kids is None:
                if name in memo:
                    stack.pop()
                    continue
                on_path.add(name)
                kids = [k for k in graph[name] if k not in on_path]
                stack[-1] = (name, kids)
                stack.extend((k, None) for k in kids if k not in memo)
                continue
            stack.pop()
            on_path.discard(name)
            memo[name] = 1 + max((memo.get(k, 0) for k in kids), default=0)
    return max(memo.values(), default=0)


# --- the check ------------------------------------------------------------------------------------------


def check_bounds(kind: str, text: str, limits: GrammarLimits) -> None:
    """Raise :class:`BoundExceeded` naming the bound a spec ``(kind, text)`` exceeds."""
    size = len(text.encode("utf-8", "surrogatepass"))
    if size > limits.max_grammar_bytes:
        raise BoundExceeded(f"it has {size} bytes, more than the limit max_grammar_bytes = {limits.max_grammar_bytes}")
    schemas = []
    if kind == "json_schema":
        schemas = [json.loads(text)]
    elif kind == "grammar":
        graph, start = rule_graph(text)
        depth = rule_depth(graph, start)
        if depth > limits.max_rule_depth:
            raise BoundExceeded(
                f"its rules reference each other {depth} deep, more than the limit "
                f"max_rule_depth = {limits.max_rule_depth}"
            )
        schemas = _json_objects(text)
    for schema in schemas:
        depth = schema_depth(schema)
        if depth > limits.max_schema_depth:
            raise BoundExceeded(
                f"its subschemas and $ref links nest {depth} deep, more than the limit "
                f"max_schema_depth = {limits.max_schema_depth}"
            )

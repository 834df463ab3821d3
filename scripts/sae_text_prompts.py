"""Write an offline text corpus as a prompt file for `lmtrace generate`, the data of `lmtrace sae train`.

The text is the Python documentation's topic pages that every CPython ships (`pydoc_data.topics`, the
language reference behind `help()`: ~465 KB of English prose and code, ~110k SmolLM2 tokens), so it
needs no network and no extra package. Each prompt is a chunk of about WORDS words, cut at whitespace;
every chunk of every topic is written, in a fixed order.

    python scripts/sae_text_prompts.py sae-text.jsonl [--words 96] [--limit N]
"""

from __future__ import annotations

import argparse
import json
from pydoc_data.topics import topics


def chunks(words_per_chunk: int):
    for name in sorted(topics):
        words = topics[name].split()
        for start in range(0, len(words), words_per_chunk):
            piece = words[start : start + words_per_chunk]
            if len(piece) >= words_per_chunk // 4:
                yield name, " ".join(piece)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out")
    parser.add_argument("--words", type=int, default=96)
    parser.add_argument("--limit", type=int, default=None, help="write at most this many prompts")
    args = parser.parse_args()
    n = 0
    with open(args.out, "w") as f:
        for name, text in chunks(args.words):
            if args.limit is not None and n >= args.limit:
                break
            f.write(json.dumps({"prompt": text, "topic": name}) + "\n")
            n += 1
    print(f"wrote {n} prompts to {args.out}")


if __name__ == "__main__":
    main()

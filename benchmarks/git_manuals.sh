#!/usr/bin/env bash
# The git-manuals benchmark: everyday questions asked of git's own manuals (Debian package
# git-doc, GPL-2.0, not redistributed here), answered by the default method and by `full`.
#
#   apt-get install git-doc           # once, as root
#   bash benchmarks/git_manuals.sh    # MODELS="smollm2 qwen2.5-coder-0.5b" by default
#
# It gathers 41 files (git's howtos, the first 20 technical notes, four HTML guides and
# the README) into benchmarks/data/git-docs, ingests them, turns the questions in
# benchmarks/data/git_questions.txt into a MuSiQue-format file of the chunks `query`
# retrieves for each (benchmarks/data/git_manuals.json; git_manuals_document.json with
# retrieval_order "document"), and runs `bench quality` on both per model, with the
# chunk-caches made as `warm` makes them (and, in file order, also as `warm --previous`).
set -euo pipefail
cd "$(dirname "$0")/.."
DOC=/usr/share/doc/git
[ -d "$DOC/html/howto" ] || { echo "git's manuals are missing: apt-get install git-doc" >&2; exit 1; }
DOCS=benchmarks/data/git-docs
rm -rf "$DOCS" && mkdir -p "$DOCS"
cp "$DOC"/html/howto/*.txt "$DOCS"/
ls "$DOC"/html/technical/*.txt | head -20 | xargs -I{} cp {} "$DOCS"/
for page in gittutorial gitcore-tutorial giteveryday user-manual; do cp "$DOC/html/$page.html" "$DOCS"/; done
cp "$DOC/README.md" "$DOCS"/
cachecraft ingest "$DOCS"
cachecraft bench dataset --questions benchmarks/data/git_questions.txt --out benchmarks/data/git_manuals.json
# the same questions with each file's retrieved chunks side by side, in the file's order
CACHECRAFT_RETRIEVAL_ORDER=document cachecraft bench dataset --questions benchmarks/data/git_questions.txt \
  --out benchmarks/data/git_manuals_document.json
# questions kept apart, for checking a setting before it is reported on the ones above
cachecraft bench dataset --questions benchmarks/data/git_questions_heldout.txt \
  --out benchmarks/data/git_manuals_heldout.json
CACHECRAFT_RETRIEVAL_ORDER=document cachecraft bench dataset --questions benchmarks/data/git_questions_heldout.txt \
  --out benchmarks/data/git_manuals_heldout_document.json
for model in ${MODELS:-smollm2 qwen2.5-coder-0.5b}; do
  cachecraft bench quality --model "$model" --dataset benchmarks/data/git_manuals.json --limit 24 \
    --warm-context builtin --methods full,cachecraft,cacheblend@0.15 \
    --out "benchmarks/results/git_manuals_${model%%-*}.json"
  cachecraft bench quality --model "$model" --dataset benchmarks/data/git_manuals_document.json --limit 24 \
    --warm-context builtin --methods full,cachecraft,cacheblend@0.15 \
    --out "benchmarks/results/git_manuals_document_${model%%-*}.json"
  # and with each chunk's cache also made after the chunk before it in its file (warm --previous)
  cachecraft bench quality --model "$model" --dataset benchmarks/data/git_manuals_document.json --limit 24 \
    --warm-context builtin --methods full,cachecraft --in-context cachecraft --neighbours 1 \
    --neighbour-pool previous --out "benchmarks/results/git_manuals_previous_${model%%-*}.json"
done

"""Hierarchical attention: a document's structure becomes the attention mask of one prefill.

    pie run inferlets/examples/hierarchical_attention.py -- --title "Pets" \
        --section "Cats|Cats sleep a lot.|Cats purr." --section "Dogs|Dogs bark." \
        --question "Which pet purrs?"

Every paragraph attends to the title, its section's heading and itself only (not to the other
paragraphs or sections), every heading to the title and itself; the question attends to
everything. The whole document is computed in one pass with that mask (`Context.submit(mask=)`,
a run-length row per token), so each paragraph's KV is independent of the rest of the document,
as if encoded alone under its headings. --flat uses the plain causal mask instead (a baseline).
--probe returns the next-token distribution after the last paragraph instead of an answer.
Returns JSON: {answer, num_prompt_tokens, segments: [[start, end, kind]]} or {probe: [[id, p]]}.
"""
import inferlet
from inferlet.generation import wait_outputs


def segments_of(title: str, sections: list[list[str]]) -> list[tuple[list[int], str, int]]:
    """(token ids, kind, section index) of every segment, in document order."""
    segments = [(inferlet.encode(f"# {title}\n"), "title", -1)]
    for index, (heading, *paragraphs) in enumerate(sections):
        segments.append((inferlet.encode(f"## {heading}\n"), "heading", index))
        segments += [(inferlet.encode(f"{p}\n"), "paragraph", index) for p in paragraphs]
    return segments


def run_lengths(visible: list[tuple[int, int]], kv_len: int) -> list[int]:
    """Sorted, disjoint attend intervals -> runs alternating attend / skip over [0, kv_len)."""
    merged: list[list[int]] = []
    for start, end in visible:
        if merged and merged[-1][1] == start:
            merged[-1][1] = end
        else:
            merged.append([start, end])
    row, cursor = [], 0
    for start, end in merged:
        if row:
            row.append(start - cursor)     # the skip run before this attend run
        elif start > 0:
            row += [0, start]              # the row starts with a skip
        row.append(end - start)
        cursor = end
    if cursor < kv_len:
        row.append(kv_len - cursor)
    return row


def mask_rows(segments: list, kv_len: int, flat: bool) -> list[list[int]]:
    """One row per token of `segments` (the first kv_len tokens of the document)."""
    bounds, start = [], 0
    for ids, kind, section in segments:
        bounds.append((start, start + len(ids), kind, section))
        start += len(ids)
    rows = []
    for start, end, kind, section in bounds:
        if flat or kind in ("title", "question"):
            visible = [(0, kv_len)]
        else:   # the title, the section's heading, then the segment itself
            visible = [(s, min(e, kv_len)) for s, e, k, sec in bounds
                       if k == "title" or (k == "heading" and sec == section) or s == start]
        row = run_lengths(visible, kv_len)
        rows += [row] * (min(end, kv_len) - start)
    return rows[:kv_len]


def parse_sections(texts: list[str]) -> list[list[str]]:
    sections = [[part.strip() for part in text.split("|")] for text in texts]
    if any(len(section) < 2 or not all(section) for section in sections):
        raise inferlet.InferletError('a --section is "heading|paragraph|..." with no empty part')
    return sections


@inferlet.main
def main(args: list[str]) -> dict:
    parser = inferlet.ArgumentParser(prog="hierarchical_attention", description=__doc__)
    parser.add_argument("--title", default="Pets")
    parser.add_argument("--section", action="append", help='"heading|paragraph|paragraph..."')
    parser.add_argument("--question", default="Which pet purrs?")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--flat", action="store_true", help="plain causal attention (baseline)")
    parser.add_argument("--probe", action="store_true", help="distribution after the last paragraph")
    opts = parser.parse_args(args)
    sections = parse_sections(opts.section or ["Cats|Cats sleep most of the day.|Cats purr.",
                                               "Dogs|Dogs bark at strangers.|Dogs love walks."])
    segments = segments_of(opts.title, sections)
    if not opts.probe:
        segments.append((inferlet.encode(f"Question: {opts.question}\nAnswer:"), "question", -1))
    token_ids = [t for ids, _, _ in segments for t in ids]
    ctx = inferlet.Context()
    ctx.fill(token_ids)
    if len(token_ids) > ctx.max_batch_tokens:
        raise inferlet.InferletError(f"the document has {len(token_ids)} tokens, one pass takes "
                                     f"at most {ctx.max_batch_tokens}")
    if opts.probe:
        rows = mask_rows(segments, len(token_ids), opts.flat)
        future = ctx.submit(ctx.take_pending(), inferlet.sampling.distribution(10), mask=rows)
        dist = wait_outputs(future)[0].value
        ctx.close()
        return {"probe": [[t, p] for t, p in zip(dist.token_ids, dist.probs)]}
    pending = ctx.take_pending()   # all but the last token in the masked pass
    ctx.submit(pending[:-1], mask=mask_rows(segments, len(pending) - 1, opts.flat))
    ctx.pending_token_ids = pending[-1:]   # the question's last token: the first decode pass
    answer = ctx.generate(opts.max_tokens, stop="\n")
    ctx.close()
    bounds, start = [], 0
    for ids, kind, _ in segments:
        bounds.append([start, start + len(ids), kind])
        start += len(ids)
    return {"answer": answer.strip(), "num_prompt_tokens": len(token_ids), "segments": bounds}

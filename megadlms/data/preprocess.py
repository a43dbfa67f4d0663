"""`megadlms preprocess`: tokenize jsonl into Megatron indexed datasets ({prefix}_{key}_document.bin/.idx).

Same flags as Megatron-LM's tools/preprocess_data.py (HuggingFaceTokenizer only). Input lines are read in
order, cut into chunks, tokenized by `--workers` processes and written back in input order, so the output
is byte-identical for any worker count. Each JSON key gets its own dataset; a line is one document; a value
that is a list of strings is one document of several sequences (Megatron's sentence layout).
"""

from __future__ import annotations

import argparse
import array
import collections
import glob
import gzip
import hashlib
import multiprocessing as mp
import os
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import MegaDLMsError, report_errors
from ..jsonl import decode_json_line
from .chat import CHAT_KEY, BadRecord, ChatRenderer, record_messages
from .indexed import IndexedDatasetBuilder, dataset_exists, optimal_dtype
from .sft import loss_mask_prefix
from .tokenizer import ASSETS_DIR, SUPPORTED_TOKENIZER_TYPES, Tokenizer, load_tokenizer

CHUNK_BYTES = 1 << 18  # ~256 KB of input per task: small enough to balance workers, big enough to amortize IPC
CHUNK_LINES = 2048
MAX_BAD_REPORTED = 20
BUNDLED_CORPUS = ASSETS_DIR / "demo_corpus.jsonl.gz"
JSONL_SUFFIXES = (".jsonl", ".jsonl.gz", ".json", ".json.gz")


class PreprocessError(MegaDLMsError, ValueError):
    """Bad preprocessing input; the message names the file (and line) and the fix."""


@dataclass
class PreprocessStats:
    """What a preprocessing run did."""

    documents: int = 0
    tokens: dict[str, int] = field(default_factory=dict)  # per JSON key
    input_bytes: int = 0  # bytes of input lines (uncompressed)
    seconds: float = 0.0
    bad_lines: int = 0
    bad_examples: list[str] = field(default_factory=list)
    outputs: dict[str, str] = field(default_factory=dict)  # JSON key -> dataset prefix

    @property
    def mb_per_s(self) -> float:
        return self.input_bytes / 1e6 / max(self.seconds, 1e-9)


def output_prefix_for(output_prefix: str | os.PathLike, key: str) -> str:
    """Megatron's naming: `{output_prefix}_{key}_document`."""
    return f"{os.fspath(output_prefix)}_{key}_document"


def resolve_inputs(inputs: str | os.PathLike | Sequence[str | os.PathLike]) -> list[Path]:
    """Files named by `inputs`: files, folders (every *.jsonl / *.jsonl.gz / *.json[.gz] inside, sorted)
    or glob patterns (sorted). Raises naming any entry that matches nothing."""
    items = [inputs] if isinstance(inputs, (str, os.PathLike)) else list(inputs)
    if not items:
        raise PreprocessError("no --input given; pass a jsonl file, a folder of jsonl files or a glob")
    files: list[Path] = []
    for item in items:
        s = os.path.expanduser(os.fspath(item))
        p = Path(s)
        if p.is_dir():
            found = sorted(q for q in p.iterdir() if q.is_file() and q.name.endswith(JSONL_SUFFIXES))
            if not found:
                raise PreprocessError(f"--input folder {s!r} holds no {'/'.join(JSONL_SUFFIXES)} files")
            files += found
        elif p.is_file():
            files.append(p)
        elif glob.has_magic(s):
            found = sorted(Path(q) for q in glob.glob(s, recursive=True) if os.path.isfile(q))
            if not found:
                raise PreprocessError(f"--input pattern {s!r} matches no files")
            files += found
        else:
            raise PreprocessError(f"--input {s!r} does not exist; pass a jsonl file, a folder or a glob pattern")
    return files


def _open_lines(path: Path):
    if path.name.endswith(".gz"):
        return gzip.open(path, "rb")
    return open(path, "rb", buffering=1 << 20)  # noqa: SIM115 - the caller closes it


def _chunks(files: list[Path]) -> Iterator[tuple[str, int, list[bytes]]]:
    """(file, first line number, raw lines) in input order."""
    for path in files:
        try:
            with _open_lines(path) as f:
                lines: list[bytes] = []
                size, first = 0, 1
                for lineno, line in enumerate(f, start=1):
                    lines.append(line)
                    size += len(line)
                    if size >= CHUNK_BYTES or len(lines) >= CHUNK_LINES:
                        yield str(path), first, lines
                        lines, size, first = [], 0, lineno + 1
                if lines:
                    yield str(path), first, lines
        except (OSError, EOFError, gzip.BadGzipFile) as e:
            raise PreprocessError(f"cannot read {path}: {e} (a truncated or corrupt .gz?)") from e


_WORKER: dict = {}


def _init_worker(tokenizer: Tokenizer, keys: tuple[str, ...], append_eod: bool, dtype: str) -> None:
    _WORKER.update(tokenizer=tokenizer, keys=keys, append_eod=append_eod, dtype=np.dtype(dtype))


def _encode_chunk(task: tuple[str, int, list[bytes]]) -> dict:
    """Tokenize one chunk. Returns per key (tokens, sequence lengths, sequences per document) plus the
    bad lines as (line number, reason); a bad line contributes to no key, so the key datasets stay aligned."""
    path, first, lines = task
    tok: Tokenizer = _WORKER["tokenizer"]
    keys, append_eod = _WORKER["keys"], _WORKER["append_eod"]
    out = {k: (array.array("i"), array.array("i"), array.array("i")) for k in keys}
    bad: list[tuple[int, str]] = []
    nbytes = ndocs = 0
    for i, raw in enumerate(lines):
        lineno = first + i
        nbytes += len(raw)
        if not raw.strip():
            continue  # blank lines (e.g. a trailing newline) are not documents
        try:
            obj = decode_json_line(raw)
        except ValueError as e:
            bad.append((lineno, str(e)))
            continue
        if not isinstance(obj, dict):
            bad.append((lineno, f"a JSON {type(obj).__name__}, expected an object with keys {list(keys)}"))
            continue
        values = {}
        for k in keys:
            v = obj.get(k)
            if isinstance(v, str):
                values[k] = [v]
            elif isinstance(v, list) and all(isinstance(x, str) for x in v):
                values[k] = v
            else:
                what = f"lacks the key {k!r}" if k not in obj else f"has {k!r} of type {type(v).__name__}"
                bad.append((lineno, f"{what} (present keys: {sorted(obj)[:10]}); --json-keys names the text "
                                    "field(s), each a string or a list of strings"))
                break
        else:
            encoded = {k: [ids for ids in (tok.encode(sentence) for sentence in values[k]) if ids] for k in keys}
            held = next((k for k in keys for ids in encoded[k] if tok.mask_id in ids), None)
            if held is not None:
                bad.append((lineno, _mask_reason(tok, f"its {held!r}")))
                continue
            ndocs += 1
            for k in keys:
                toks, seq_lens, per_doc = out[k]
                for ids in encoded[k]:
                    toks.extend(ids)
                    seq_lens.append(len(ids))
                if encoded[k] and append_eod:
                    toks.append(tok.eod_id)
                    seq_lens[-1] += 1
                per_doc.append(len(encoded[k]))
    dtype = _WORKER["dtype"]
    result = {k: (np.frombuffer(t, dtype=np.int32).astype(dtype), np.frombuffer(s, dtype=np.int32),
                  np.frombuffer(d, dtype=np.int32)) for k, (t, s, d) in out.items()}
    return {"path": path, "keys": result, "bad": bad, "bytes": nbytes, "docs": ndocs}


def _mask_reason(tok: Tokenizer, what: str) -> str:
    """Why a document whose text (`what`) tokenizes to the mask id is refused: a diffusion model cannot train on
    it (the loader would stop at it)."""
    return (f"{what} holds the mask token {tok.mask_token!r} (id {tok.mask_id}), which a masked-diffusion model "
            "cannot be trained on (the text spells the token out); remove it from the text")


def _init_chat_worker(renderer: ChatRenderer, dtype: str) -> None:
    _WORKER.update(renderer=renderer, dtype=np.dtype(dtype))


def _encode_chat_chunk(task: tuple[str, int, list[bytes]]) -> dict:
    """Render one chunk of chat records: the tokens and the loss masks (one document per conversation), plus
    the bad lines as (line number, reason)."""
    path, first, lines = task
    renderer: ChatRenderer = _WORKER["renderer"]
    toks, masks, lens = array.array("i"), array.array("b"), array.array("i")
    bad: list[tuple[int, str]] = []
    nbytes = ndocs = 0
    for i, raw in enumerate(lines):
        lineno = first + i
        nbytes += len(raw)
        if not raw.strip():
            continue
        try:
            obj = decode_json_line(raw)
        except ValueError as e:
            bad.append((lineno, str(e)))
            continue
        try:
            ids, mask = renderer.encode(record_messages(obj))
        except BadRecord as e:
            bad.append((lineno, str(e)))
            continue
        if renderer.tokenizer.mask_id is not None and renderer.tokenizer.mask_id in ids:
            bad.append((lineno, _mask_reason(renderer.tokenizer, "the conversation")))
            continue
        toks.extend(ids)
        masks.extend(mask)
        lens.append(len(ids))
        ndocs += 1
    dtype = _WORKER["dtype"]
    ones = np.ones(len(lens), dtype=np.int32)
    result = {CHAT_KEY: (np.frombuffer(toks, dtype=np.int32).astype(dtype), np.frombuffer(lens, dtype=np.int32), ones),
              "mask": (np.frombuffer(masks, dtype=np.int8).astype(np.uint8), np.frombuffer(lens, dtype=np.int32),
                       ones)}
    return {"path": path, "keys": result, "bad": bad, "bytes": nbytes, "docs": ndocs}


def _init_pool_worker(init, *initargs) -> None:
    # One core per worker: the Rust tokenizer must not start its own thread pool inside each process.
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    init(*initargs)


def _results(files: list[Path], workers: int, initargs: tuple, init=_init_worker, encode=_encode_chunk
             ) -> Iterator[dict]:
    """Encoded chunks in input order; at most a few chunks per worker are in flight (bounded memory)."""
    tasks = _chunks(files)
    if workers <= 1:
        init(*initargs)
        for t in tasks:
            yield encode(t)
        return
    # fork shares the loaded tokenizer for free; spawn would re-import torch in every worker.
    ctx = mp.get_context("fork") if "fork" in mp.get_all_start_methods() else mp.get_context()
    pool = ctx.Pool(workers, initializer=_init_pool_worker, initargs=(init, *initargs))
    try:
        pending: collections.deque = collections.deque()
        for t in tasks:
            pending.append(pool.apply_async(encode, (t,)))
            if len(pending) >= 4 * workers:
                yield pending.popleft().get()
        while pending:
            yield pending.popleft().get()
        pool.close()
    finally:
        pool.terminate()
        pool.join()


def preprocess_jsonl(inputs: str | os.PathLike | Sequence[str | os.PathLike], output_prefix: str | os.PathLike,
               tokenizer: Tokenizer, *, json_keys: Sequence[str] = ("text",), append_eod: bool = False,
               workers: int = 1, skip_bad_lines: bool = False, progress: bool = True,
               chat: bool = False, prompt_template: str | None = None) -> PreprocessStats:
    """Tokenize jsonl `inputs` into one indexed dataset per key, `{output_prefix}_{key}_document`.

    chat=True: the records are conversations (`megadlms.data.chat`); writes `{output_prefix}_chat_document`
    (tokens, one document per conversation) and beside it the uint8 loss masks with the same documents
    (`loss_mask_prefix`); `json_keys` and `append_eod` do not apply.

    Token dtype: uint16 if tokenizer.vocab_size < 65500 else int32. A bad line (not UTF-8, not JSON, missing a
    key) raises PreprocessError naming file and line, unless `skip_bad_lines`, which counts and reports them.
    Outputs appear only when complete (temporary files are renamed at the end)."""
    if workers < 1:
        raise PreprocessError(f"--workers must be at least 1, got {workers}")
    keys = (CHAT_KEY,) if chat else tuple(json_keys)
    if not keys or len(set(keys)) != len(keys):
        raise PreprocessError(f"--json-keys must name distinct keys, got {list(keys)}")
    files = resolve_inputs(inputs)
    dtype = optimal_dtype(tokenizer.vocab_size)
    stats = PreprocessStats(tokens={k: 0 for k in keys},
                            outputs={k: output_prefix_for(output_prefix, k) for k in keys})
    if chat:
        renderer = ChatRenderer(tokenizer, prompt_template=prompt_template)
        work: dict[str, Any] = dict(initargs=(renderer, dtype.str), init=_init_chat_worker,
                                    encode=_encode_chat_chunk)
    else:
        work = dict(initargs=(tokenizer, keys, append_eod, dtype.str))
    total = None if any(f.name.endswith(".gz") for f in files) else sum(f.stat().st_size for f in files)
    builders = {k: IndexedDatasetBuilder(stats.outputs[k], dtype) for k in keys}
    if chat:
        builders["mask"] = IndexedDatasetBuilder(loss_mask_prefix(stats.outputs[CHAT_KEY]), np.uint8)
    bar = None
    if progress:
        from tqdm import tqdm
        bar = tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1000, desc="preprocess",
                   mininterval=1.0, file=sys.stderr, dynamic_ncols=True)
    t0 = time.perf_counter()
    try:
        for r in _results(files, workers, **work):
            for lineno, reason in r["bad"]:
                where = f"{r['path']}, line {lineno}: {reason}"
                if not skip_bad_lines:
                    raise PreprocessError(f"{where}; fix the line or pass --skip-bad-lines to skip such lines")
                stats.bad_lines += 1
                if len(stats.bad_examples) < MAX_BAD_REPORTED:
                    stats.bad_examples.append(where)
            for k, (toks, lens, per_doc) in r["keys"].items():
                builders[k].add_documents(toks, lens, per_doc)
                if k in stats.tokens:
                    stats.tokens[k] += int(toks.size)
            stats.documents += r["docs"]
            stats.input_bytes += r["bytes"]
            if bar is not None:
                bar.update(r["bytes"])
                elapsed = max(time.perf_counter() - t0, 1e-9)
                bar.set_postfix_str(f"{stats.documents / elapsed:,.0f} docs/s", refresh=False)
        for b in builders.values():
            b.finalize()
    except BaseException:
        for b in builders.values():
            b.abort()
        raise
    finally:
        if bar is not None:
            bar.close()
        _WORKER.clear()
    stats.seconds = time.perf_counter() - t0
    return stats


# --------------------------------------------------------------------------- bundled corpus


def bundled_dataset(tokenizer: Tokenizer, cache_dir: str | os.PathLike, *, progress: bool = True) -> str:
    """Prefix of the bundled demo corpus tokenized with `tokenizer` (with EOD appended), preprocessing it into
    `cache_dir` on first use. The folder name hashes the corpus bytes and the tokenizer, so a different
    tokenizer gets its own copy; concurrent callers are safe (outputs are renamed into place atomically)."""
    h = hashlib.sha256(BUNDLED_CORPUS.read_bytes())
    h.update(tokenizer.fingerprint.encode())
    out_dir = Path(cache_dir) / f"bundled-{h.hexdigest()[:16]}"
    prefix = output_prefix_for(out_dir / "demo_corpus", "text")
    if not dataset_exists(prefix):
        out_dir.mkdir(parents=True, exist_ok=True)
        if progress:
            print(f"megadlms: tokenizing the bundled demo corpus into {out_dir} (first use only)", file=sys.stderr)
        preprocess_jsonl(BUNDLED_CORPUS, out_dir / "demo_corpus", tokenizer, append_eod=True, progress=progress)
    return prefix


# --------------------------------------------------------------------------- command line


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Register the preprocessing flags (Megatron-LM tools/preprocess_data.py names)."""
    g = parser.add_argument_group("input data")
    g.add_argument("--input", nargs="+", required=True,
                   help="jsonl file(s) (.jsonl or .jsonl.gz), a folder of them, or a glob pattern")
    g.add_argument("--json-keys", nargs="+", default=["text"], help="keys to extract from each JSON line")
    g.add_argument("--skip-bad-lines", action="store_true",
                   help="skip lines that are not UTF-8 / JSON or lack a key (counted and reported) instead of "
                        "stopping at the first")
    g.add_argument("--chat", action="store_true",
                   help="the lines are conversations ('messages' or 'prompt'/'response'): write "
                        "{prefix}_chat_document with per-token loss masks (assistant tokens) for `train --sft`")
    g.add_argument("--prompt-template", default=None,
                   help="with --chat, for tokenizers without a chat template: the text around each user turn, "
                        "e.g. 'User: {prompt}\\nAssistant: ' (assistant turns are followed by the EOD token)")
    g = parser.add_argument_group("tokenizer")
    g.add_argument("--tokenizer-type", default="HuggingFaceTokenizer",
                   help=f"tokenizer kind; supported: {', '.join(SUPPORTED_TOKENIZER_TYPES)} (a tokenizer.json)")
    g.add_argument("--tokenizer-model", default=None,
                   help="tokenizer.json or a folder holding one (default: the bundled 4096-token BPE)")
    g.add_argument("--append-eod", action="store_true", help="append the end-of-document token to each document")
    g = parser.add_argument_group("output data")
    g.add_argument("--output-prefix", required=True,
                   help="writes {prefix}_{key}_document.bin/.idx for each --json-keys key")
    g = parser.add_argument_group("runtime")
    g.add_argument("--num-workers", "--workers", dest="workers", type=int, default=1,
                   help="tokenizer processes (output is identical for any N); --workers is the same flag")
    g.add_argument("--log-interval", type=int, default=1000, help="accepted for Megatron compatibility; "
                   "progress is shown continuously")
    g.add_argument("--no-progress", action="store_true", help="no progress bar (there is none unless stderr is a "
                   "terminal)")


def run(args: argparse.Namespace) -> int:
    """Run preprocessing for parsed `args`; prints a summary. Returns 0; bad input raises (a MegaDLMsError)."""
    tokenizer = load_tokenizer(args.tokenizer_model, tokenizer_type=args.tokenizer_type)
    try:
        stats = preprocess_jsonl(args.input, args.output_prefix, tokenizer, json_keys=args.json_keys,
                                 append_eod=args.append_eod, workers=args.workers, skip_bad_lines=args.skip_bad_lines,
                                 progress=not args.no_progress and sys.stderr.isatty(), chat=args.chat,
                                 prompt_template=args.prompt_template)
    except OSError as e:  # an unwritable --output-prefix, a full disk, an unreadable input
        where = f"{e.filename}: " if e.filename else f"--output-prefix {args.output_prefix}: "
        raise PreprocessError(f"{where}{e.strerror or e}; check the path and the free space") from None
    print(f"{stats.documents:,} documents, {stats.input_bytes / 1e6:.1f} MB in {stats.seconds:.1f} s "
          f"({stats.mb_per_s:.1f} MB/s, {stats.documents / max(stats.seconds, 1e-9):,.0f} docs/s, "
          f"{args.workers} worker{'s' if args.workers > 1 else ''})")
    for k, prefix in stats.outputs.items():
        print(f"  {k}: {stats.tokens[k]:,} tokens -> {prefix}.bin / .idx")
        if args.chat:
            print(f"  loss masks (assistant tokens) -> {loss_mask_prefix(prefix)}.bin / .idx")
    if not stats.documents or not any(stats.tokens.values()):
        print(f"warning: the output holds no tokens ({stats.documents} documents): training on it stops with an "
              "error; check --input and --json-keys", file=sys.stderr)
    if stats.bad_lines:
        print(f"skipped {stats.bad_lines} bad line(s):", file=sys.stderr)
        for ex in stats.bad_examples:
            print(f"  {ex}", file=sys.stderr)
        if stats.bad_lines > len(stats.bad_examples):
            print(f"  ... and {stats.bad_lines - len(stats.bad_examples)} more", file=sys.stderr)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="megadlms preprocess", description=__doc__.split("\n\n")[0])
    add_arguments(parser)
    return report_errors(parser.prog, lambda: run(parser.parse_args(argv)))


if __name__ == "__main__":
    sys.exit(main())

"""Prepare training data once: documents -> tokenizer -> token files that the training scripts read with np.memmap.

    python prepare_data.py                                  # the builtin corpus -> data/ (what the scripts read)
    python prepare_data.py --data corpus.jsonl --out data/corpus --vocab-size 16384
    python prepare_data.py --data books/ --eval-data held_out.txt --tokenizer path/to/llama-3-8b
    python prepare_data.py --data hf:HuggingFaceFW/fineweb:sample-10BT --max-tokens 2_000_000_000

It reads the documents (--data), trains a BPE tokenizer on them (or takes --tokenizer), and writes into --out
train-NNNNN.bin and val.bin (every document bos, ids, eos, packed), the tokenizer and meta.json; a rerun of the
same request does nothing. The sources, the held-out split, memory, --out and reading it back: docs/data.md.
"""

import argparse
import codecs
import fcntl
import hashlib
import json
import logging
import os
import re
import shutil
import signal
import sys
import sysconfig
import tempfile
import time
from typing import NamedTuple

import numpy as np
from tqdm import tqdm

FORMAT = 1  # meta.json's "format": bump it when the layout changes, so readers can tell
SHARD_TOKENS = 100_000_000  # a new train-NNNNN.bin after this many tokens
HELD_OUT_EVERY = 50  # without --eval-data, documents 49, 99, 149, ... (from 0) are the held-out split
HELD_OUT_TAIL = 10  # ... unless those make less than a window: then the last 1/10 of the tokens instead
MIN_TOKENS = 129  # each split must fill one window of the scripts' default --seq-len 128, plus one
WINDOW = f"one window of {MIN_TOKENS} tokens (the training scripts' default --seq-len 128, plus one)"
# Memory: tokenizers takes ~150 bytes a character to encode a text, ~40 once encoded: a document longer than
# PIECE_CHARS is encoded in pieces (see in_pieces), and pieces are encoded together (encode_batch runs them in
# parallel) up to BATCH_DOCUMENTS of them or BATCH_CHARS characters: ~160 MB, however long a document is.
PIECE_CHARS = 100_000
BATCH_DOCUMENTS = 1000
BATCH_CHARS = 4_000_000
READ_BYTES = 1 << 20  # a .txt is read this many bytes of a line at a time: one line can be a whole book
VOCAB_SIZE = 8192  # of a tokenizer trained here, unless --vocab-size
TOKENIZER_TRAIN_CHARS = 20_000_000  # a trained tokenizer sees at most this much text
# BPE training time grows with the square of a pre-token's length (400k characters without a space: 19 s): the
# trainer sees texts cut into pieces of at most this many characters, at whitespace where there is some.
TOKENIZER_PIECE_CHARS = 1000
SPECIAL_TOKENS = ("[PAD]", "[BOT]", "[EOT]")
EXTENSIONS = (".txt", ".jsonl", ".parquet")
OWN_FILES = re.compile(r"(train-\d{5}\.bin|val\.bin|meta\.json|tokenizer\.json|tokenizer_config\.json)\Z")


class UsageError(Exception):
    """A mistake in the command line or its inputs: one line on stderr, exit status 1, nothing written."""


# ----------------------------------------------------------------------------------------------------------
# The pipeline: read the documents -> tokenize them -> write the token files (into a temporary folder,
# which the run below renames to --out)

def write_dataset(tmp: str, args, source: dict, identity: str, tokenizer: "Tokenizer | None") -> dict:
    """The dataset args ask for, written into the folder tmp (prepare() renames it to --out once whole): the
    documents read, a tokenizer trained on them (or the --tokenizer given), every document tokenized into the
    token files, a held-out split, and meta.json last. Returns the meta."""
    held_out = not args.eval_data
    if tokenizer is None:
        vocab_size = args.vocab_size or VOCAB_SIZE
        print(f"training a byte-level BPE tokenizer ({vocab_size:,} tokens) on the first "
              f"{TOKENIZER_TRAIN_CHARS:,} characters of --data {args.data}", flush=True)
        tokenizer = train_tokenizer((text for part, text, _ in split(documents(args.data, args.text_field),
                                                                     held_out) if part == "train"), vocab_size)
    backend = tokenizer.backend
    # get_vocab_size() can be below the largest id + 1 (a vocabulary with holes): the dtype must hold that id.
    dtype = token_dtype(max(backend.get_vocab_size(), max(backend.get_vocab().values()) + 1))
    sha256 = save_tokenizer(tokenizer, tmp)
    files = {"train": TokenFiles(tmp, "train", dtype, SHARD_TOKENS), "val": TokenFiles(tmp, "val", dtype)}
    # disable=None: no bar off a terminal (logs, tests), so that an error there stays one line.
    try:
        with tqdm(desc="tokenizing", unit=" documents", disable=None, leave=False) as bar:
            tokenize(split(documents(args.data, args.text_field), held_out), tokenizer, files, bar, args.max_tokens)
            if args.eval_data:
                tokenize((("val", text, end) for text, end in documents(args.eval_data, args.text_field,
                                                                         "--eval-data")), tokenizer, files, bar)
    finally:
        for f in files.values():
            f.close()
    kind = "documents" if held_out else "eval_data"
    if held_out and files["val"].total < MIN_TOKENS:
        hold_out_tail(tmp, files, args)  # it sees to both splits' windows
        kind = "tail"
    train, val = files["train"], files["val"]
    if train.total < MIN_TOKENS:  # a cut at --max-tokens is a window at least: too few documents
        raise UsageError(f"--data {args.data}: the training split holds {train.total} tokens "
                         f"({_count(train.documents, 'document')}), fewer than {WINDOW}; give more documents")
    if val.total < MIN_TOKENS:
        raise UsageError(f"--eval-data {args.eval_data}: the held-out split holds {val.total} tokens "
                         f"({_count(val.documents, 'document')}), fewer than {WINDOW}; give more held-out "
                         "documents, or leave --eval-data out to hold out part of --data")
    meta = {"format": FORMAT, "dtype": dtype, "vocab_size": backend.get_vocab_size(),
            "bos_id": backend.token_to_id(tokenizer.bos), "eos_id": backend.token_to_id(tokenizer.eos),
            "bos_token": tokenizer.bos, "eos_token": tokenizer.eos,
            **{part: {"files": f.files, "tokens": f.tokens, "documents": f.documents} for part, f in files.items()},
            "source": source, "fingerprint": identity, "tokenizer_sha256": sha256}
    meta["val"]["held_out"] = kind  # "documents" (every 50th), "tail" (the last tokens) or "eval_data"
    with open(os.path.join(tmp, "meta.json"), "w") as f:  # last: its presence says the rest is complete
        json.dump(meta, f, indent=1)
    return meta


def hold_out_tail(directory: str, files: dict, args) -> None:
    """Too few documents to hold out whole ones: val.bin becomes the last 1/HELD_OUT_TAIL of the token stream (at
    least one window), the few held-out documents' tokens at its end, and the training files lose that tail."""
    train, val = files["train"], files["val"]
    total = train.total + val.total
    size = max(MIN_TOKENS, total // HELD_OUT_TAIL)
    if total - size < MIN_TOKENS:
        if args.max_tokens and train.total >= args.max_tokens:
            raise UsageError(f"--max-tokens {args.max_tokens}: too few tokens for {WINDOW} to train on and another "
                             "held out (the documents are too few to hold out whole ones, so the last tokens are); "
                             f"give --max-tokens {2 * MIN_TOKENS} or more, or held-out documents with --eval-data")
        raise UsageError(f"--data {args.data}: {total} tokens ({_count(train.documents + val.documents, 'document')}), "
                         f"too few for {WINDOW} to train on and another held out; give more documents")
    itemsize = np.dtype(train.dtype).itemsize
    spans, take = [], size - val.total  # (file, first token, tokens) of the tail, from the last file backwards
    for name, count in reversed(list(zip(train.files, train.tokens))):
        spans.insert(0, (name, count - min(take, count), min(take, count)))
        take -= spans[0][2]
        if not take:
            break
    with open(os.path.join(directory, "tail.tmp"), "wb") as tail:
        for name, first, count in spans + [("val.bin", 0, val.total)]:
            with open(os.path.join(directory, name), "rb") as f:
                f.seek(first * itemsize)
                left = count * itemsize
                while left:  # in pieces: a tail can be large
                    chunk = f.read(min(left, 1 << 24))
                    tail.write(chunk)
                    left -= len(chunk)
    for name, first, _ in spans:
        os.truncate(os.path.join(directory, name), first * itemsize)
        train.tokens[train.files.index(name)] = first
    while not train.tokens[-1]:
        os.remove(os.path.join(directory, train.files.pop()))
        train.tokens.pop()
    os.replace(os.path.join(directory, "tail.tmp"), os.path.join(directory, "val.bin"))
    val.tokens = [size]


# ----------------------------------------------------------------------------------------------------------
# The run: --out written whole or not at all, never over what this tool did not write

def prepare(args) -> dict | None:
    """Write the dataset args ask for into args.out; returns its meta, or None when args.out was ready."""
    started = time.time()
    source, identity = request(args)
    out = os.path.abspath(args.out)  # absolute: its parent and name are what `--out .` means too
    if _ready(args, out, source, identity):  # before anything is written, not even the lock
        return None
    check_inputs(args, out)
    if args.max_tokens is not None and args.max_tokens < MIN_TOKENS:
        raise UsageError(f"--max-tokens {args.max_tokens}: fewer than {WINDOW}; give at least {MIN_TOKENS}")
    tokenizer = load_tokenizer(args.tokenizer) if args.tokenizer else None  # a bad one fails before any writing

    parent = os.path.dirname(out)
    made, probe = None, parent  # made: the topmost folder this run creates, removed again if it fails
    while not os.path.exists(probe):
        made, probe = probe, os.path.dirname(probe)
    held = None
    try:
        try:
            os.makedirs(parent, exist_ok=True)
            held = lock(out, args.out)
        except OSError as e:
            raise UsageError(f"--out {args.out}: cannot create a folder or file in {parent} ({e.strerror or e})") \
                from None
        remove_leftovers(out)
        if _ready(args, out, source, identity):  # a run that held the lock until a moment ago prepared it
            return None
        check_out(args, out, source, identity)
        meta = _build(out, args, source, identity, tokenizer)
    except BaseException as e:  # including Ctrl-C and SIGTERM: _build has removed its temporary folder
        if made:
            shutil.rmtree(made, ignore_errors=True)
        if isinstance(e, OSError):
            raise UsageError(f"--out {args.out}: cannot write ({e.strerror or e})") from None
        raise
    finally:
        if held:
            unlock(*held)
    train, val = meta["train"], meta["val"]
    how = f"the last {100 // HELD_OUT_TAIL} % of the tokens: too few documents to hold out whole ones" \
        if val["held_out"] == "tail" else _count(val["documents"], "document")
    print(f"prepared {args.out}: {sum(train['tokens']):,} training tokens ({_count(train['documents'], 'document')}, "
          f"{len(train['files'])} file{'s' * (len(train['files']) > 1)}) + {val['tokens'][0]:,} held-out "
          f"({how}; val.bin), {meta['dtype']}, vocabulary {meta['vocab_size']:,}, in {time.time() - started:.0f}s")
    return meta


def _build(out: str, args, source: dict, identity: str, tokenizer: "Tokenizer | None") -> dict:
    """Writes the dataset into a temporary folder beside out (named with the pid, so that a later run can tell
    it is left over) and renames it to out, replacing what is there."""
    parent, base = os.path.split(out)
    tmp = tempfile.mkdtemp(prefix=f".{base}.{os.getpid()}.", suffix=".tmp", dir=parent)
    try:
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o777 & ~umask)  # mkdtemp's folder is private; the dataset should not be
        meta = write_dataset(tmp, args, source, identity, tokenizer)
        if os.path.lexists(out):  # replaced (--force, or an empty folder): moved aside first, so a failure keeps it
            os.rename(out, old := tmp + ".old")
            try:
                os.rename(tmp, out)
            except OSError:
                os.rename(old, out)
                raise
            _remove(old)
        else:
            os.rename(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return meta


def request(args) -> tuple[dict, str]:
    """What is asked (meta.json's "source") and what it is made of (its "fingerprint"): a rerun with both equal
    finds --out ready. Checks the sources exist, so a missing path fails before anything is written."""
    if args.tokenizer and args.vocab_size:
        raise UsageError("--vocab-size: only for a tokenizer trained here; the --tokenizer given has its own "
                         "vocabulary, leave one of the two out")
    source = {"data": args.data, "eval_data": args.eval_data, "tokenizer": args.tokenizer,
              "vocab_size": None if args.tokenizer else args.vocab_size or VOCAB_SIZE,
              "text_field": args.text_field, "max_tokens": args.max_tokens}
    parts = [f"data={fingerprint(args.data, '--data')}"]
    if args.eval_data:
        parts.append(f"eval_data={fingerprint(args.eval_data, '--eval-data')}")
    if args.tokenizer:  # an edited tokenizer file makes the old tokens stale too
        parts.append("tokenizer=" + ";".join(_file_identity(f) for f in _tokenizer_files(args.tokenizer)))
    return source, " | ".join(parts)


def _tokenizer_files(path: str) -> list[str]:
    files = [os.path.join(path, n) for n in ("tokenizer.json", "tokenizer_config.json")] \
        if os.path.isdir(path) else [path]
    return [f for f in files if os.path.isfile(f)]


def _inside(path: str, folder: str) -> bool:
    return path == folder or path.startswith(os.path.join(folder, ""))


def check_inputs(args, out: str) -> None:
    """Refuses an --out that is, holds or lies inside anything read (real paths), and --eval-data overlapping --data."""
    read = []  # (flag, path as given, real path) of every file and folder read
    for flag, spec in (("--data", args.data), ("--eval-data", args.eval_data)):
        if spec == "builtin":
            read.append((flag, spec, os.path.realpath(sysconfig.get_paths()["stdlib"])))
        elif spec and not spec.startswith("hf:"):
            paths = [p for p in spec.split(",") if p] + source_files(spec, flag)
            read += [(flag, p, os.path.realpath(p)) for p in paths]
    if args.tokenizer:
        read += [("--tokenizer", p, os.path.realpath(p)) for p in [args.tokenizer, *_tokenizer_files(args.tokenizer)]]
    real_out = os.path.realpath(out)
    for flag, given, real in read:
        if _inside(real, real_out) or _inside(real_out, real):
            how = "is" if real == real_out else "holds" if _inside(real, real_out) else "lies inside"
            raise UsageError(f"--out {args.out}: it {how} {flag} {given}, which this run reads; choose another --out "
                             "(a dataset never replaces what it is made from, --force or not)")
    overlap = args.eval_data == args.data or any(
        _inside(e, d) or _inside(d, e) for flag_e, _, e in read if flag_e == "--eval-data"
        for flag_d, _, d in read if flag_d == "--data")
    if args.eval_data and overlap:
        raise UsageError(f"--eval-data {args.eval_data}: it overlaps --data {args.data}, so the held-out loss would "
                         "be on training documents; give documents --data does not hold, or leave --eval-data out "
                         f"to hold out every {HELD_OUT_EVERY}th document of --data")


def read_meta(out: str) -> dict | None:
    """--out's meta.json if --out is a complete dataset (every file there, of the size it claims), else None."""
    try:
        with open(os.path.join(out, "meta.json")) as f:
            meta = json.load(f)
        size = np.dtype(meta["dtype"]).itemsize
        complete = os.path.isfile(os.path.join(out, "tokenizer.json")) and all(
            os.path.getsize(os.path.join(out, name)) == tokens * size
            for part in ("train", "val") for name, tokens in zip(meta[part]["files"], meta[part]["tokens"]))
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return meta if complete and meta.get("format") == FORMAT else None


def _ready(args, out: str, source: dict, identity: str) -> bool:
    meta = read_meta(out)
    if meta and meta["source"] == source and meta["fingerprint"] == identity:
        print(f"{args.out} is ready: prepared before from this same request (meta.json); nothing to do")
        return True
    return False


def _count(n: int, noun: str) -> str:
    return f"{n:,} {noun}{'s' * (n != 1)}"


def _some(names: list[str]) -> str:
    return ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")


def holding(out: str) -> tuple[str, dict | None, bool]:
    """What a non-empty --out holds, in words; its meta.json; whether --force may replace it: only a dataset this
    tool wrote (its meta.json, with "format", and nothing but the files it lists and the tokenizer's)."""
    if not os.path.isdir(out):
        return "is not a folder", None, False
    names = sorted(os.listdir(out))
    try:
        with open(os.path.join(out, "meta.json")) as f:
            meta = json.load(f)
        listed = {name for part in ("train", "val") for name in meta[part]["files"]} | \
            {"meta.json", "tokenizer.json", "tokenizer_config.json"}
        if "format" not in meta:
            raise KeyError("format")
    except OSError:
        return f"holds other files ({_some(names)})", None, False
    except (ValueError, KeyError, TypeError):  # a damaged meta.json: ours only if every name is one we write
        others = [n for n in names if not OWN_FILES.match(n)]
        if others:
            return f"holds a damaged meta.json and other files ({_some(others)})", None, False
        return "holds a damaged dataset (its meta.json is not one this tool wrote whole)", None, True
    others = [n for n in names if n not in listed]
    if others:
        return f"holds a dataset and other files ({_some(others)})", meta, False
    return "holds a dataset", meta, True


def _changes(meta: dict, source: dict, identity: str) -> str:
    """How the dataset meta describes differs from what is asked, in words."""
    if meta.get("format") != FORMAT:
        return f"of another format ({meta.get('format')}; this version writes {FORMAT})"
    old = meta.get("source") if isinstance(meta.get("source"), dict) else {}
    flags = [f"--{key.replace('_', '-')} {'unset' if old.get(key) is None else old.get(key)} -> "
             f"{'unset' if value is None else value}" for key, value in source.items() if old.get(key) != value]
    if flags:
        return f"prepared with other flags ({', '.join(flags)})"
    before, now = (dict(p.split("=", 1) for p in str(f).split(" | ") if "=" in p)
                   for f in (meta.get("fingerprint"), identity))
    stale = [f"--{key.replace('_', '-')}" for key in now if before.get(key) != now[key]]
    if stale:
        return f"prepared with these flags, but the files of {' and '.join(stale)} changed since"
    return "incomplete (files missing, or not of the sizes its meta.json gives)"


def check_out(args, out: str, source: dict, identity: str) -> None:
    """Refuses an --out holding what this tool did not write, and without --force a dataset of another request."""
    if not os.path.lexists(out) or (os.path.isdir(out) and not os.listdir(out)):
        return
    what, meta, ours = holding(out)
    if not ours:
        raise UsageError(f"--out {args.out}: it {what}, not a dataset prepared here; choose another --out "
                         "(--force replaces only a dataset this tool wrote, never other files)")
    if not args.force:
        what = f"holds a dataset {_changes(meta, source, identity)}" if meta else what
        raise UsageError(f"--out {args.out}: it {what}; choose another --out, or add --force to replace it")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's: alive
        return True
    except (OverflowError, ValueError):
        return False
    return True


def _remove(path: str) -> None:
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path, ignore_errors=True)
    elif os.path.lexists(path):
        os.remove(path)


def lock(out: str, shown: str) -> tuple[str, int]:
    """Holds --out (an absolute path) against a second run: an flock on .OUT.lock beside it, which the system
    frees when its process ends however it ends, and which holds the pid for the message. Returns unlock's args."""
    path = os.path.join(os.path.dirname(out), f".{os.path.basename(out)}.lock")
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            pid = os.read(fd, 32).decode(errors="replace").strip() or "?"
            os.close(fd)
            raise UsageError(f"--out {shown}: another prepare_data.py (pid {pid}) is writing it now; wait for it to "
                             "end, or choose another --out") from None
        try:
            if os.stat(path).st_ino == os.fstat(fd).st_ino:
                break
        except FileNotFoundError:
            pass
        os.close(fd)  # its holder removed it between our open and flock: lock the one there now
    os.ftruncate(fd, 0)
    os.write(fd, f"{os.getpid()}\n".encode())
    return path, fd


def unlock(path: str, fd: int) -> None:
    try:
        os.remove(path)  # while still held, so that no one locks the removed file
    except FileNotFoundError:
        pass
    os.close(fd)


def remove_leftovers(out: str) -> None:
    """Removes the temporary folders of earlier runs into out (absolute) whose process is gone (killed outright)."""
    parent, base = os.path.split(out)
    leftover = re.compile(re.escape(f".{base}.") + r"(\d+)\.\w+\.tmp(\.old)?\Z")
    for name in os.listdir(parent):
        match = leftover.match(name)
        if match and not _alive(int(match[1])):
            _remove(os.path.join(parent, name))


# ----------------------------------------------------------------------------------------------------------
# Documents

def builtin_files() -> list[str]:
    """The standard library's .py files in a fixed order (tests and vendored packages left out)."""
    root = sysconfig.get_paths()["stdlib"]
    skip = {"site-packages", "test", "tests", "idlelib", "__pycache__"}
    files = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in skip)
        files += [os.path.join(dirpath, f) for f in sorted(filenames) if f.endswith(".py")]
    return files


def source_files(spec: str, flag: str = "--data") -> list[str]:
    """The local files of a comma-separated list of files and folders, checked to exist and to be readable kinds."""
    files = []
    for item in (p for p in spec.split(",") if p):
        if os.path.isdir(item):
            found = _folder_files(item)
            if not found:
                raise UsageError(f"{flag} {item}: a folder without .txt, .jsonl or .parquet files")
            files += found
        elif not os.path.exists(item):
            raise UsageError(f"{flag}: no such file or folder {item!r}; give .txt/.jsonl/.parquet files or folders, "
                             "builtin, or hf:NAME[:CONFIG[:SPLIT]]")
        elif os.path.splitext(item)[1].lower() not in EXTENSIONS:
            raise UsageError(f"{flag} {item}: not a .txt, .jsonl or .parquet file")
        else:
            files.append(item)
    if not files:
        raise UsageError(f"{flag}: empty; give builtin, files or folders, or hf:NAME[:CONFIG[:SPLIT]]")
    return files


def _folder_files(folder: str) -> list[str]:
    found = []
    for dirpath, dirnames, names in os.walk(folder):
        dirnames[:] = [d for d in dirnames if not d.startswith(".")]  # .git, .cache and the like hold no documents
        found += [os.path.join(dirpath, n) for n in names
                  if os.path.splitext(n)[1].lower() in EXTENSIONS and not n.startswith(".")]
    return sorted(found)


def fingerprint(spec: str, flag: str = "--data") -> str:
    """What the documents behind a spec are, cheaply (os.stat only): it changes when they change."""
    if spec == "builtin":
        files = builtin_files()
        return f"builtin:{sys.version}:{len(files)}:{sum(os.stat(f).st_size for f in files)}"
    if spec.startswith("hf:"):
        if not spec[3:].split(":")[0]:
            raise UsageError(f"{flag} {spec}: no dataset name; write hf:NAME[:CONFIG[:SPLIT]]")
        return spec  # a remote dataset: its name is all we can know without opening it
    return ";".join(_file_identity(p) for p in source_files(spec, flag))


def _file_identity(path: str) -> str:
    stat = os.stat(path)
    return f"{os.path.abspath(path)}:{stat.st_size}:{stat.st_mtime_ns}"


def documents(spec: str, text_field: str = "text", flag: str = "--data"):
    """The documents of a source, in order, as (piece, end): pieces of at most PIECE_CHARS characters (see in_pieces),
    end: the piece is its document's last. A problem is a UsageError naming the file and line (or row)."""
    return in_pieces(_texts(spec, text_field, flag), PIECE_CHARS)


def _texts(spec: str, text_field: str, flag: str):
    """(text, end) as documents() says, in parts of any length: a .txt's as read, the other sources' whole."""
    if spec == "builtin":
        for path in builtin_files():
            with open(path, encoding="utf-8", errors="replace") as f:
                yield f.read(), True
    elif spec.startswith("hf:"):
        yield from _hf_documents(spec, text_field, flag)
    else:
        for path in source_files(spec, flag):
            reader = {".txt": _txt, ".jsonl": _jsonl, ".parquet": _parquet}[os.path.splitext(path)[1].lower()]
            try:  # a .jsonl line or a .parquet row is read whole: its text is in memory (a .txt's never is)
                yield from reader(path, text_field, f"{flag} {path}")
            except OSError as e:
                raise UsageError(f"{flag} {path}: cannot be read ({e.strerror or e})") from None


def _txt(path: str, text_field: str, where: str):
    """A .txt's paragraphs (lines up to a blank one, joined by "\\n") as (text, end), in parts of at most
    READ_BYTES: a line is read and decoded in parts, so that no long line or paragraph is held whole."""
    decoder = codecs.getincrementaldecoder("utf-8")()
    number, at, blank, paragraph, held = 1, 0, True, False, ""
    # at: bytes of the line before this part; blank: the line so far is whitespace; paragraph: one has begun; held:
    # text not yet known to be the document's (a line's leading whitespace, until the line shows it is not blank;
    # a part's last "\r"s, which the line's end would strip)
    with open(path, "rb") as f:
        while True:
            raw = f.readline(READ_BYTES)
            last = len(raw) < READ_BYTES or raw.endswith(b"\n")  # the line ends here (or the file does)
            pending = len(decoder.getstate()[0])  # the bytes of a character that the last part cut
            try:
                text = held + decoder.decode(raw, final=last)
            except UnicodeDecodeError as e:  # e.start counts from the pending bytes
                raise UsageError(f"{where}, line {number}: not UTF-8 text ({e.reason} at byte "
                                 f"{at - pending + e.start} of the line); give text files in UTF-8") from None
            at += len(raw)
            text = text.rstrip("\r\n") if last else text
            if blank and (not text or text.isspace()):
                held = "" if last else text
                if last and paragraph:  # a blank line ends a paragraph
                    yield "", True
                    paragraph = False
            else:
                if blank:  # the line's first text
                    text, blank, paragraph = "\n" + text if paragraph else text, False, True
                keep = len(text) if last else len(text.rstrip("\r"))
                text, held = text[:keep], text[keep:]
                if text:
                    yield text, False
            if last:
                number, at, blank, held = number + 1, 0, True, ""
            if not raw:
                break
    if paragraph:
        yield "", True


def _text_of(row, text_field: str, where: str) -> str:
    if not isinstance(row, dict):
        raise UsageError(f"{where}: a JSON {type(row).__name__}, not an object with a {text_field!r} string")
    if not isinstance(row.get(text_field), str):
        found = f"{text_field!r} is {json.dumps(row[text_field], default=str)[:40]}, not a string" \
            if text_field in row else f"no {text_field!r} field (it has {sorted(row)[:8]})"
        raise UsageError(f"{where}: {found}; name the field that holds the text with --text-field, or fix that row")
    try:  # a JSON escape such as "\ud800" gives a string no tokenizer can take
        row[text_field].encode("utf-8")
    except UnicodeEncodeError as e:
        raise UsageError(f"{where}: the text holds a lone surrogate ({row[text_field][e.start]!a} at character "
                         f"{e.start}), not valid Unicode; fix that row") from None
    return row[text_field]


def _jsonl(path: str, text_field: str, where: str):
    with open(path, "rb") as f:
        for number, raw in enumerate(f, 1):
            if not raw.strip():
                continue
            try:
                row = json.loads(raw)
            except UnicodeDecodeError as e:
                raise UsageError(f"{where}, line {number}: not UTF-8 ({e.reason})") from None
            except json.JSONDecodeError as e:
                raise UsageError(f"{where}, line {number}: not valid JSON ({e.msg} at column {e.colno}); each line "
                                 "must be one JSON object") from None
            yield _text_of(row, text_field, f"{where}, line {number}"), True


def _parquet(path: str, text_field: str, where: str):
    import pyarrow as pa  # comes with datasets; imported here so that other sources do not pay for it
    import pyarrow.parquet as pq

    try:
        parquet = pq.ParquetFile(path)
    except (pa.ArrowException, OSError) as e:
        raise UsageError(f"{where}: not a readable parquet file ({_first_line(e)})") from None
    schema = parquet.schema_arrow
    if text_field not in schema.names:
        raise UsageError(f"{where}: no {text_field!r} column (it has {schema.names[:8]}); name the column that holds "
                         "the text with --text-field")
    kind = schema.field(text_field).type
    if not (pa.types.is_string(kind) or pa.types.is_large_string(kind)):
        raise UsageError(f"{where}: the {text_field!r} column holds {kind}, not strings; see --text-field")
    row = 0
    for batch in parquet.iter_batches(batch_size=BATCH_DOCUMENTS, columns=[text_field]):
        for text in batch.column(0).to_pylist():
            row += 1
            if text is None:
                raise UsageError(f"{where}, row {row}: {text_field!r} is null, not a string; fix or drop that row")
            yield text, True


def _hf_documents(spec: str, text_field: str, flag: str):
    import datasets  # slow to import: only hf: sources pay for it

    name, config, hf_split = (spec[3:].split(":") + [None, None])[:3]
    # Their retry notes while opening would turn the one-line error into a dozen lines: quiet until it is open.
    loggers = [logging.getLogger(n) for n in ("datasets", "huggingface_hub")]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.ERROR)
    try:
        dataset = datasets.load_dataset(name, config or None, split=hf_split or "train", streaming=True)
    except Exception as e:  # network, unknown name or config: the user's input, not a bug here
        raise UsageError(f"{flag} {spec}: cannot open the dataset ({_first_line(e)})") from None
    finally:
        for logger, level in zip(loggers, levels):
            logger.setLevel(level)
    if dataset.features is not None and text_field not in dataset.features:
        raise UsageError(f"{flag} {spec}: no {text_field!r} field (it has {sorted(dataset.features)[:8]}); name the "
                         "field that holds the text with --text-field")
    rows, number = iter(dataset), 0
    while True:
        try:
            row = next(rows)
        except StopIteration:
            return
        except Exception as e:  # a stream that breaks midway (a bad shard, the network)
            raise UsageError(f"{flag} {spec}: cannot read document {number + 1} ({_first_line(e)})") from None
        number += 1
        yield _text_of(row, text_field, f"{flag} {spec}, document {number}"), True


def _first_line(error: Exception) -> str:
    return (str(error).strip().splitlines() or [type(error).__name__])[0][:200]


def in_pieces(texts, size: int):
    """(text, end) parts of documents (end: the part is its document's last) -> the same documents as (piece, end),
    pieces of at most size characters, cut where byte-level tokenizers begin a token (see _piece_end)."""
    parts, length = [], 0  # what is not yet a piece (joined only once it makes one: a .txt comes a line at a time)
    for text, end in texts:
        parts.append(text)
        length += len(text)
        if length > size or end:
            text, start = "".join(parts), 0
            while len(text) - start > size:
                cut = _piece_end(text, start, size)
                yield text[start:cut], False
                start = cut
            parts, length = [text[start:]], len(text) - start
            if end:
                yield parts.pop(), True
                length = 0


def _piece_end(text: str, start: int, size: int) -> int:
    """Where the piece of text from start ends, at most size characters on: before the last space that stands between
    two non-space characters, else after the last newline that does, else after size characters. The pre-tokenizers
    of byte-level BPE (the one trained here, GPT-2's, Llama 3's) begin a token at both, Metaspace ones that split at
    spaces at the first: the pieces' ids are then the whole text's (docs/data.md says where not)."""
    end = min(start + size, len(text) - 2) + 1  # (the character after the space or newline must be there)
    for sep, after in ((" ", 0), ("\n", 1)):
        cut = end - after
        while (cut := text.rfind(sep, start + 1, cut)) != -1:
            if not (text[cut - 1].isspace() or text[cut + 1].isspace()):
                return cut + after
    return start + size


def split(texts, held_out: bool):
    """("train" | "val", piece, end) for each (piece, end) of documents(); held_out: every HELD_OUT_EVERY-th
    document is "val"."""
    index = 0
    for text, end in texts:
        yield "val" if held_out and index % HELD_OUT_EVERY == HELD_OUT_EVERY - 1 else "train", text, end
        index += end


# ----------------------------------------------------------------------------------------------------------
# Tokenizer

class Tokenizer(NamedTuple):
    """A tokenizers.Tokenizer and the tokens that frame every document: bos before it, eos after it."""
    backend: object
    bos: str
    eos: str
    pad: str | None


def load_tokenizer(path: str) -> Tokenizer:
    """A tokenizer.json (or a folder holding one) with [BOT]/[EOT], or the bos/eos its tokenizer_config.json names."""
    from tokenizers import Tokenizer as Backend

    file = os.path.join(path, "tokenizer.json") if os.path.isdir(path) else path
    if not os.path.isfile(file):
        raise UsageError(f"--tokenizer: no such file {file!r}; give a tokenizer.json, a Hugging Face model folder "
                         "holding one, or leave the flag out to train one on --data")
    try:
        backend = Backend.from_file(file)
    except Exception as e:
        raise UsageError(f"--tokenizer {file}: not a tokenizers JSON file ({_first_line(e)})") from None
    # Documents must come out whole: a tokenizer.json may carry truncation or padding settings, drop them.
    backend.no_truncation()
    backend.no_padding()

    def has(token) -> bool:
        return token is not None and backend.token_to_id(token) is not None

    if has("[BOT]") and has("[EOT]"):
        return Tokenizer(backend, "[BOT]", "[EOT]", "[PAD]" if has("[PAD]") else None)
    try:
        with open(os.path.join(os.path.dirname(file), "tokenizer_config.json")) as f:
            config = json.load(f)
    except (OSError, ValueError):
        config = {}
    # A token is a string, or {"content": string, ...} (an AddedToken) in older files.
    named = {key: value["content"] if isinstance(value, dict) else value for key, value in config.items()
             if key in ("bos_token", "eos_token", "pad_token") and isinstance(value, (str, dict))}
    if not (has(named.get("bos_token")) and has(named.get("eos_token"))):
        raise UsageError(f"--tokenizer {file}: no [BOT]/[EOT] tokens and no tokenizer_config.json beside it naming a "
                         "bos_token and an eos_token it has; documents are framed by them")
    pad = named.get("pad_token")
    return Tokenizer(backend, named["bos_token"], named["eos_token"], pad if has(pad) else None)


def train_tokenizer(texts, vocab_size: int) -> Tokenizer:
    """A byte-level BPE tokenizer with [PAD], [BOT], [EOT], trained on the first TOKENIZER_TRAIN_CHARS of texts."""
    from tokenizers import Tokenizer as Backend, decoders, models, pre_tokenizers, trainers

    # Read here, not from inside the trainer (which pulls from another thread, where Ctrl-C and SIGTERM cannot
    # stop it): a slow or stuck source can be interrupted, and the sample is at most 20M characters.
    sample, seen = [], 0
    with tqdm(desc="reading for the tokenizer", total=TOKENIZER_TRAIN_CHARS, unit=" characters", unit_scale=True,
              disable=None, leave=False) as bar:
        for text in texts:
            text = text[:TOKENIZER_TRAIN_CHARS - seen]
            sample += pieces(text)
            seen += len(text)
            bar.update(len(text))
            if seen == TOKENIZER_TRAIN_CHARS:
                break

    backend = Backend(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    # Its own bars (counting pairs, computing merges) only on a terminal, so that logs and errors stay clean.
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=sys.stderr.isatty())
    backend.train_from_iterator(sample, trainer)
    return Tokenizer(backend, "[BOT]", "[EOT]", "[PAD]")


def pieces(text: str, size: int = TOKENIZER_PIECE_CHARS):
    """text in pieces of at most size characters, each cut before the last space or newline of a run of whitespace
    (where the pre-tokenizer cuts too: the pre-tokens stay as they were), or after size characters if none."""
    start = 0
    while len(text) - start > size:
        cut = start + size
        while True:  # back to a space or newline that is followed by something else
            cut = max(text.rfind(" ", start + 1, cut), text.rfind("\n", start + 1, cut))
            if cut < 0 or not text[cut + 1].isspace():
                break
        cut = cut if cut > 0 else start + size
        yield text[start:cut]
        start = cut
    yield text[start:]


def save_tokenizer(tokenizer: Tokenizer, directory: str) -> str:
    """tokenizer.json and tokenizer_config.json in directory; returns the sha256 of tokenizer.json.

    Every training document began with bos, so the saved tokenizer puts bos before what it encodes with
    add_special_tokens (transformers' default): a post-processor adds it, unless the tokenizer does already."""
    from tokenizers import Tokenizer as Backend, processors

    backend = Backend.from_str(tokenizer.backend.to_str())  # a copy: the one that encodes the data stays as it is
    bos_id = backend.token_to_id(tokenizer.bos)
    if backend.encode("x", add_special_tokens=True).ids[:1] != [bos_id]:
        template = processors.TemplateProcessing(single=f"{tokenizer.bos} $A",
                                                 pair=f"{tokenizer.bos} $A {tokenizer.bos} $B",
                                                 special_tokens=[(tokenizer.bos, bos_id)])
        backend.post_processor = template if backend.post_processor is None else \
            processors.Sequence([backend.post_processor, template])
    path = os.path.join(directory, "tokenizer.json")
    backend.save(path)
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": tokenizer.bos, "eos_token": tokenizer.eos,
              **({"pad_token": tokenizer.pad} if tokenizer.pad else {}), "add_bos_token": True, "add_eos_token": False}
    with open(os.path.join(directory, "tokenizer_config.json"), "w") as f:
        json.dump(config, f, indent=1)
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def token_dtype(vocab_size: int) -> str:
    """The smallest unsigned type that holds every id below vocab_size."""
    return "uint16" if vocab_size <= 2**16 else "uint32"


# ----------------------------------------------------------------------------------------------------------
# Token files

class TokenFiles:
    """Token ids appended to one file (val.bin), or to shards of shard_tokens each (train-00000.bin, ...)."""

    def __init__(self, directory: str, name: str, dtype: str, shard_tokens: int | None = None):
        self.directory, self.name, self.dtype, self.shard_tokens = directory, name, dtype, shard_tokens
        self.files, self.tokens, self.documents = [], [], 0
        self._file = None
        self._next_file()

    def _next_file(self) -> None:
        if self._file is not None:
            self._file.close()
        name = f"{self.name}-{len(self.files):05d}.bin" if self.shard_tokens else f"{self.name}.bin"
        self._file = open(os.path.join(self.directory, name), "wb")
        self.files.append(name)
        self.tokens.append(0)

    @property
    def total(self) -> int:
        return sum(self.tokens)

    def write(self, ids: list[int]) -> None:
        ids = np.array(ids, dtype=self.dtype)  # numpy refuses an id that does not fit, rather than wrapping it
        while len(ids):
            if self.shard_tokens and self.tokens[-1] == self.shard_tokens:
                self._next_file()  # only when more tokens come: no empty last shard
            room = self.shard_tokens - self.tokens[-1] if self.shard_tokens else len(ids)
            ids[:room].tofile(self._file)
            self.tokens[-1] += len(ids[:room])
            ids = ids[room:]

    def close(self) -> None:
        self._file.close()


def tokenize(stream, tokenizer: Tokenizer, files: dict, bar, max_tokens: int | None = None) -> None:
    """Append each document of stream ((part, piece, end), as split gives) to files[part] as bos, ids, eos; stop
    once the training files hold max_tokens (the last document cut short)."""
    bos, eos = tokenizer.backend.token_to_id(tokenizer.bos), tokenizer.backend.token_to_id(tokenizer.eos)
    first = True  # the next piece begins a document
    for batch in batches(stream):
        encodings = tokenizer.backend.encode_batch([text for _, text, _ in batch], add_special_tokens=False)
        ids = {"train": [], "val": []}
        for (part, _, end), encoding in zip(batch, encodings):
            piece = [bos] * first + encoding.ids + [eos] * end
            if part == "train" and max_tokens is not None:
                room = max_tokens - files["train"].total - len(ids["train"])
                if room <= 0:
                    break
                piece = piece[:room]
            ids[part] += piece
            files[part].documents += first
            first = end
        for part, part_ids in ids.items():
            files[part].write(part_ids)
        bar.update(sum(end for _, _, end in batch))
        bar.set_postfix_str(f"{files['train'].total:,} train + {files['val'].total:,} val tokens")
        if max_tokens is not None and files["train"].total >= max_tokens:
            return


def batches(stream):
    """Lists of the items of stream, BATCH_DOCUMENTS at most and BATCH_CHARS characters (item[1]) about."""
    batch, chars = [], 0
    for item in stream:
        batch.append(item)
        chars += len(item[1])
        if len(batch) == BATCH_DOCUMENTS or chars >= BATCH_CHARS:
            yield batch
            batch, chars = [], 0
    if batch:
        yield batch


# ----------------------------------------------------------------------------------------------------------
# Command line

class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line instead of the usage block; --help has the rest
        self.exit(2, f"error: {message} (see --help)\n")


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                epilog="What each flag takes, and what --out holds: docs/data.md.")
    p.add_argument("--data", default="builtin", metavar="SPEC",
                   help="builtin, .txt/.jsonl/.parquet files/folders (comma-separated), or hf:NAME "
                        "(default: %(default)s)")
    p.add_argument("--out", default="data", metavar="DIR", help="the folder to write (default: %(default)s)")
    p.add_argument("--tokenizer", metavar="PATH", help="a tokenizer.json or a Hugging Face model folder "
                                                       "(default: train a BPE tokenizer on --data)")
    p.add_argument("--vocab-size", type=_positive, metavar="N",
                   help=f"of the tokenizer trained here (default: {VOCAB_SIZE})")
    p.add_argument("--text-field", default="text", metavar="NAME",
                   help="the .jsonl/.parquet/hf: field holding the text (default: %(default)s)")
    p.add_argument("--eval-data", metavar="SPEC",
                   help=f"held-out documents, as --data (default: every {HELD_OUT_EVERY}th of --data)")
    p.add_argument("--max-tokens", type=_positive, metavar="N",
                   help="stop after this many training tokens (default: all)")
    p.add_argument("--force", action="store_true", help="replace a dataset prepared here from another request")
    return p


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised wherever the program is, so that it cleans up as after Ctrl-C."""


def _terminate(signum, frame):
    raise Terminated


def main(argv=None) -> None:
    args = build_parser().parse_args(argv)
    try:
        previous = signal.signal(signal.SIGTERM, _terminate)
    except ValueError:  # not the main thread (called from one): no handler to install
        previous = None
    try:
        prepare(args)
    except UsageError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(1)
    except KeyboardInterrupt as e:  # prepare() has removed its temporary folder
        print("interrupted: nothing written", file=sys.stderr)
        sys.exit(128 + signal.SIGTERM if isinstance(e, Terminated) else 130)
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


if __name__ == "__main__":
    main()

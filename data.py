"""Training data for the pipeline scripts: documents -> BPE tokenizer -> packed windows -> batches.

``--data`` names where documents come from:

    builtin                    the .py sources of this Python's standard library: ~11 MB of real text that is
                               on every machine, so the default run needs no download
    PATH[,PATH...]             local .txt (UTF-8, one document per paragraph), .jsonl (one JSON object per line,
                               its "text" string is the document) or .parquet files (a string "text" column),
                               read with the `datasets` builders of the same names; every file is checked
                               before training (validate_files)
    hf:NAME[:CONFIG[:SPLIT]]   a Hugging Face dataset, streamed (e.g. hf:HuggingFaceFW/fineweb:sample-10BT):
                               training starts as soon as the first documents arrive

Documents are wrapped in [BOT] ... [EOT], joined into one token stream and cut into windows of seq_len + 1
tokens (inputs = window[:-1], targets = window[1:]); consecutive windows share one token so every token is a
target exactly once. No position is spent on padding. Attention is causal across the whole window, so a
document may attend to the end of the previous one, as is usual for packed pretraining.

Order is deterministic: the builtin corpus is tokenized once (cached) and its windows are shuffled with a
permutation drawn from (seed, epoch); streamed sources are read in their own order. Either loader reports its
position with ``state_dict()`` and continues from it with ``load_state_dict()``. The first and the last
pipeline stage each run their own loader with the same arguments and so see identical batches.
"""

import copy
import dataclasses
import hashlib
import json
import os
import sys
import sysconfig

import torch
from torch import Tensor

from runtime import FlagError, UsageError, collective_errors

SPECIAL_TOKENS = ("[PAD]", "[BOT]", "[EOT]")
IGNORE_INDEX = -100  # target value that the loss skips; [PAD] targets are mapped to it
VOCAB_SIZE = 8192  # of a tokenizer trained on --data, unless --vocab-size
TOKENIZER_TRAIN_CHARS = 20_000_000  # a trained tokenizer sees at most this much text
_FILE_BUILDERS = {".txt": "text", ".jsonl": "json", ".parquet": "parquet"}


# ----------------------------------------------------------------------------------------------------------
# Document sources

def builtin_files() -> list[str]:
    """The standard library's .py files in a fixed order (tests and vendored packages left out)."""
    root = sysconfig.get_paths()["stdlib"]
    skip = {"site-packages", "test", "tests", "idlelib", "__pycache__"}
    files = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in skip)
        files += [os.path.join(dirpath, f) for f in sorted(filenames) if f.endswith(".py")]
    return files


def check_data_spec(spec: str, flag: str = "--data") -> None:
    """Raise FlagError for a --data (or --eval-data) value that cannot work whatever the files hold."""
    if spec == "builtin" or (spec.startswith("hf:") and len(spec) > 3):
        return
    paths = [p for p in spec.split(",") if p]
    if not paths:
        raise FlagError(f"{flag}: empty; use builtin, local files or hf:NAME[:CONFIG]")
    exts = {os.path.splitext(p)[1].lower() for p in paths}
    if len(exts) != 1 or next(iter(exts)) not in _FILE_BUILDERS:
        raise FlagError(f"{flag}: files must share one extension out of {sorted(_FILE_BUILDERS)}, "
                        f"got {sorted(exts)}")


def local_files(spec: str) -> list[str]:
    return [] if spec == "builtin" or spec.startswith("hf:") else [p for p in spec.split(",") if p]


def check_files(spec: str, flag: str = "--data") -> None:
    """Every local file of --data exists and can be opened (cheap; the contents: validate_files)."""
    for path in local_files(spec):
        if not os.path.isfile(path):
            raise UsageError(f"{flag}: no such file {path!r}; give existing .txt/.jsonl/.parquet files, "
                             "builtin, or hf:NAME[:CONFIG]")
        try:
            open(path, "rb").close()
        except OSError as e:
            raise UsageError(f"{flag} {path}: cannot be read ({e.strerror})") from None


def validate_files(spec: str, cache_dir: str, flag: str = "--data") -> None:
    """Check every local file of --data through to its end, before training: .txt decodes as UTF-8, each .jsonl
    line is a JSON object with a "text" string, each .parquet file has a string "text" column. The first problem
    is a UsageError naming the file and line. A file that passed is remembered (by path, size and modification
    time) under cache_dir, so a rerun does not read it again."""
    for path in local_files(spec):
        stat = os.stat(path)
        key = hashlib.sha256(f"v1|{os.path.abspath(path)}|{stat.st_size}|{stat.st_mtime_ns}".encode()).hexdigest()
        marker = os.path.join(cache_dir, "validated", key[:16])
        if os.path.isfile(marker):
            continue
        {".txt": _validate_text, ".jsonl": _validate_jsonl, ".parquet": _validate_parquet}[
            os.path.splitext(path)[1].lower()](path, flag)
        _atomic_write(marker, lambda tmp: open(tmp, "w").close())


def _validate_text(path: str, flag: str) -> None:
    lines_before = 0
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            chunk += f.readline()  # end on a line break, so no character is cut in two
            try:
                chunk.decode("utf-8")
            except UnicodeDecodeError as e:
                line = lines_before + chunk.count(b"\n", 0, e.start) + 1
                column = e.start - (chunk.rfind(b"\n", 0, e.start) + 1)
                raise UsageError(f"{flag} {path}, line {line}: not UTF-8 text ({e.reason} at byte {column} of the "
                                 "line); give text files in UTF-8") from None
            lines_before += chunk.count(b"\n")


def _validate_jsonl(path: str, flag: str) -> None:
    with open(path, "rb") as f:
        for number, raw in enumerate(f, 1):
            if not raw.strip():
                continue  # blank lines are skipped by the reader too
            where = f"{flag} {path}, line {number}"
            try:
                row = json.loads(raw)
            except UnicodeDecodeError as e:
                raise UsageError(f"{where}: not UTF-8 ({e.reason})") from None
            except json.JSONDecodeError as e:
                raise UsageError(f"{where}: not valid JSON ({e.msg} at column {e.colno}); each line must be one "
                                 "JSON object") from None
            if not isinstance(row, dict):
                raise UsageError(f"{where}: a JSON {type(row).__name__}, not an object with a \"text\" string")
            if not isinstance(row.get("text"), str):
                found = f"\"text\" is {json.dumps(row['text'])[:40]}" if "text" in row else \
                    f"no \"text\" field (it has {sorted(row)[:5]})"
                raise UsageError(f"{where}: {found}; every row needs a \"text\" string (fix or drop that row)")


def _validate_parquet(path: str, flag: str) -> None:
    import pyarrow as pa  # comes with datasets
    import pyarrow.parquet as pq

    try:
        schema = pq.read_schema(path)
    except (pa.ArrowException, OSError) as e:
        raise UsageError(f"{flag} {path}: not a readable parquet file ({str(e).splitlines()[0]})") from None
    if "text" not in schema.names:
        raise UsageError(f"{flag} {path}: no \"text\" column (it has {schema.names[:5]}); documents are read "
                         "from a string column named text")
    if not pa.types.is_string(schema.field("text").type) and not pa.types.is_large_string(schema.field("text").type):
        raise UsageError(f"{flag} {path}: the \"text\" column holds {schema.field('text').type}, not strings")


def open_stream(spec: str):
    """A `datasets` IterableDataset of {"text": ...} documents for a local-file or hf: spec."""
    import datasets  # imported here: the builtin corpus and --help do not need it

    if spec.startswith("hf:"):
        name, config, split = (spec[3:].split(":") + [None, None])[:3]
        try:
            ds = datasets.load_dataset(name, config or None, split=split or "train", streaming=True)
        except Exception as e:  # network, unknown name or config: the user's input, not our bug
            first_line = (str(e).strip().splitlines() or [type(e).__name__])[0]
            raise UsageError(f"--data {spec}: cannot open the dataset ({first_line})") from None
    else:
        paths = spec.split(",")
        builder = _FILE_BUILDERS[os.path.splitext(paths[0])[1].lower()]
        kwargs = {"sample_by": "paragraph"} if builder == "text" else {}
        ds = datasets.load_dataset(builder, data_files=paths, split="train", streaming=True, **kwargs)
    if ds.features is not None and "text" not in ds.features:
        raise UsageError(f"--data {spec}: documents need a 'text' column, found {sorted(ds.features)}")
    return ds.select_columns(["text"])


def _read_file(path: str) -> str:
    with open(path, encoding="utf-8", errors="replace") as f:
        return f.read()


def iter_documents(spec: str):
    """The texts of a source in order. Opens the source now, so a bad spec fails here and not mid-iteration."""
    if spec == "builtin":
        return map(_read_file, builtin_files())
    return _documents(open_stream(spec), spec)


def _documents(dataset, spec: str, read: int = 0):
    """The "text" of each row of a streamed dataset, checked as it arrives: a row without a text string, or a
    row the source cannot deliver, is a UsageError that says which document (counted from the epoch's start)."""
    rows = iter(dataset)
    while True:
        try:
            row = next(rows)
        except StopIteration:
            return
        except Exception as e:  # a streamed source that breaks mid-way (a bad shard, the network)
            first = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
            raise UsageError(f"--data {spec}: cannot read document {read + 1} ({first})") from None
        read += 1
        if not isinstance(row.get("text"), str):
            raise UsageError(f"--data {spec}: document {read} has no text ({row.get('text')!r}); every row needs "
                             "a \"text\" string")
        yield row["text"]


def _source_fingerprint(spec: str) -> str:
    """Changes when the documents behind a spec change, so stale caches are not reused."""
    if spec == "builtin":
        files = builtin_files()
        return f"builtin:{sys.version}:{len(files)}:{sum(os.path.getsize(f) for f in files)}"
    if spec.startswith("hf:"):
        return spec
    return ";".join(f"{os.path.abspath(p)}:{os.path.getsize(p)}:{os.path.getmtime(p)}" for p in spec.split(","))


def _atomic_write(path: str, write) -> None:
    # Several processes (one per node, or a user's second run) may build the same cache file at once:
    # each writes its own temporary file and renames it, so readers never see half a file.
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    tmp = f"{path}.tmp{os.getpid()}"
    write(tmp)
    os.replace(tmp, path)


# ----------------------------------------------------------------------------------------------------------
# Tokenizer

@dataclasses.dataclass
class Tokenizer:
    """A `tokenizers` tokenizer and the tokens that frame every document: bos before it, eos after it.

    This project's tokenizers have [BOT] and [EOT] (and [PAD]); a Hugging Face tokenizer.json names its own in
    the tokenizer_config.json beside it (Llama 3: <|begin_of_text|>, <|end_of_text|>)."""
    backend: object  # tokenizers.Tokenizer
    bos: str
    eos: str
    pad: str | None = None

    @property
    def bos_id(self) -> int:
        return self.backend.token_to_id(self.bos)

    @property
    def eos_id(self) -> int:
        return self.backend.token_to_id(self.eos)

    @property
    def pad_id(self) -> int | None:
        return None if self.pad is None else self.backend.token_to_id(self.pad)

    def vocab_size(self) -> int:
        return self.backend.get_vocab_size()

    def encode_documents(self, texts: list[str]) -> list[list[int]]:
        return [[self.bos_id, *enc.ids, self.eos_id]
                for enc in self.backend.encode_batch(texts, add_special_tokens=False)]

    def fingerprint(self) -> str:
        return hashlib.sha256(f"{self.backend.to_str()}|{self.bos}|{self.eos}|{self.pad}".encode()).hexdigest()[:16]

    def save(self, directory: str, add_bos: bool = False, **config) -> None:
        """tokenizer.json, and a tokenizer_config.json that names the special tokens (so transformers'
        AutoTokenizer loads it too; config: more of its fields, e.g. model_max_length).

        add_bos: make the saved tokenizer put bos before every text it encodes (with add_special_tokens, as
        transformers encodes by default), as every training document began with it: a post-processor that adds
        it, unless the tokenizer already does (Llama 3's does)."""
        from tokenizers import Tokenizer as Backend, processors

        backend = self.backend
        if add_bos and backend.encode("x", add_special_tokens=True).ids[:1] != [self.bos_id]:
            backend = Backend.from_str(backend.to_str())  # a copy: this run's own tokenizer stays as it is
            bos = processors.TemplateProcessing(single=f"{self.bos} $A", pair=f"{self.bos} $A {self.bos} $B",
                                                special_tokens=[(self.bos, self.bos_id)])
            backend.post_processor = bos if backend.post_processor is None else \
                processors.Sequence([backend.post_processor, bos])
        backend.save(os.path.join(directory, "tokenizer.json"))
        fields = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": self.bos, "eos_token": self.eos,
                  **({"pad_token": self.pad} if self.pad else {}),
                  **({"add_bos_token": True, "add_eos_token": False} if add_bos else {}), **config}
        with open(os.path.join(directory, "tokenizer_config.json"), "w") as f:
            json.dump(fields, f, indent=1)


def load_tokenizer(path: str, flag: str = "--tokenizer") -> Tokenizer:
    """A tokenizers JSON file, with [BOT]/[EOT] or the bos/eos tokens its tokenizer_config.json names."""
    from tokenizers import Tokenizer as Backend

    if not os.path.isfile(path):
        raise UsageError(f"{flag}: no such file {path!r}; give a tokenizers JSON file or leave the flag out "
                         "to train one on --data")
    try:
        backend = Backend.from_file(path)
    except Exception:
        raise UsageError(f"{flag}: {path!r} is not a tokenizers JSON file") from None
    if backend.token_to_id("[BOT]") is not None and backend.token_to_id("[EOT]") is not None:
        return Tokenizer(backend, "[BOT]", "[EOT]", "[PAD]" if backend.token_to_id("[PAD]") is not None else None)
    named = _special_tokens(os.path.join(os.path.dirname(path), "tokenizer_config.json"))
    if any(named.get(t) is None or backend.token_to_id(named[t]) is None for t in ("bos_token", "eos_token")):
        raise UsageError(f"{flag}: {path!r} has no [BOT]/[EOT] tokens and no tokenizer_config.json beside it that "
                         "names a bos_token and an eos_token it has; documents are framed by them")
    pad = named.get("pad_token")
    return Tokenizer(backend, named["bos_token"], named["eos_token"],
                     pad if pad is not None and backend.token_to_id(pad) is not None else None)


def _special_tokens(config_path: str) -> dict:
    try:
        with open(config_path) as f:
            config = json.load(f)
    except (OSError, ValueError):
        return {}
    # A token is a string, or {"content": string, ...} (AddedToken) in older files.
    return {key: value["content"] if isinstance(value, dict) else value for key, value in config.items()
            if key in ("bos_token", "eos_token", "pad_token") and isinstance(value, (str, dict))}


def tokenizer_cache_path(spec: str, vocab_size: int, cache_dir: str) -> str:
    key = hashlib.sha256(f"v1|{_source_fingerprint(spec)}|{vocab_size}".encode()).hexdigest()[:16]
    return os.path.join(cache_dir, f"tokenizer-{key}.json")


def train_tokenizer(spec: str, vocab_size: int) -> Tokenizer:
    """A byte-level BPE tokenizer with [PAD], [BOT], [EOT], trained on the first documents of the source."""
    from tokenizers import Tokenizer as Backend, decoders, models, pre_tokenizers, trainers

    documents = iter_documents(spec)

    def sample():
        seen = 0
        for text in documents:
            yield text
            seen += len(text)
            if seen >= TOKENIZER_TRAIN_CHARS:
                return

    backend = Backend(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    backend.train_from_iterator(sample(), trainer)
    return Tokenizer(backend, "[BOT]", "[EOT]", "[PAD]")


def get_tokenizer(spec: str, tokenizer_path: str | None, vocab_size: int, cache_dir: str) -> Tokenizer:
    """The tokenizer at --tokenizer, else the one trained on --data before (cached), else train it now."""
    if tokenizer_path:
        return load_tokenizer(tokenizer_path)
    path = tokenizer_cache_path(spec, vocab_size, cache_dir)
    if not os.path.isfile(path):
        tokenizer = train_tokenizer(spec, vocab_size)
        _atomic_write(path, lambda tmp: tokenizer.backend.save(tmp))
    return load_tokenizer(path)


# ----------------------------------------------------------------------------------------------------------
# Loaders: both hand out batches (inputs, targets), each [batch_size, seq_len] int64, and know their position.

class _Windows:
    def __init__(self, seq_len: int, batch_size: int, pad_id: int | None):
        self.seq_len, self.batch_size, self.pad_id = seq_len, batch_size, pad_id

    def next_batch(self) -> tuple[Tensor, Tensor]:
        windows = torch.stack([self._next_window() for _ in range(self.batch_size)])
        inputs, targets = windows[:, :-1].clone(), windows[:, 1:].clone()
        if self.pad_id is not None:  # only text brought with its own [PAD]s has any; packing adds none
            targets[targets == self.pad_id] = IGNORE_INDEX
        return inputs, targets


class ShuffledWindows(_Windows):
    """A fixed token array cut into windows, visited in a fresh seeded permutation each epoch."""

    def __init__(self, tokens: Tensor, seq_len: int, batch_size: int, seed: int, pad_id: int | None = None):
        super().__init__(seq_len, batch_size, pad_id)
        self.tokens, self.seed = tokens, seed
        self.num_windows = (len(tokens) - 1) // seq_len
        if self.num_windows < 1:
            raise UsageError(f"--seq-len {seq_len}: the data holds only {len(tokens)} tokens; use a shorter --seq-len")
        self.epoch, self.index = 0, 0
        self._order = self._permutation(0)

    def _permutation(self, epoch: int) -> Tensor:
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
        return torch.randperm(self.num_windows, generator=gen)

    def _next_window(self) -> Tensor:
        if self.index == self.num_windows:
            self.epoch, self.index = self.epoch + 1, 0
            self._order = self._permutation(self.epoch)
        start = int(self._order[self.index]) * self.seq_len
        self.index += 1
        return self.tokens[start:start + self.seq_len + 1].long()

    def describe(self) -> str:
        return (f"{len(self.tokens):,} tokens packed into {self.num_windows:,} windows of {self.seq_len + 1}, "
                f"shuffled with seed {self.seed}, no padding")

    def state_dict(self) -> dict:
        return {"kind": "shuffled", "epoch": self.epoch, "index": self.index}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.index = state["epoch"], state["index"]
        self._order = self._permutation(self.epoch)


class StreamedWindows(_Windows):
    """Documents streamed in order, tokenized a few at a time, joined and cut; the source repeats at its end."""

    DOCS_PER_READ = 32  # documents tokenized together (encode_batch runs them in parallel)

    def __init__(self, spec: str, tokenizer, seq_len: int, batch_size: int, pad_id: int | None = None):
        super().__init__(seq_len, batch_size, pad_id)
        self.spec, self.tokenizer = spec, tokenizer
        self.buffer: list[int] = []
        self.epoch = 0
        self._start_epoch(None, 0)
        while len(self.buffer) < seq_len + 1:  # read the first window now: an unreadable source fails here
            self._read()

    def _start_epoch(self, stream_state: dict | None, documents: int) -> None:
        self._dataset = open_stream(self.spec)
        if stream_state is not None:
            self._dataset.load_state_dict(stream_state)
        self._iter = _documents(self._dataset, self.spec, documents)
        self._stream_state = copy.deepcopy(self._dataset.state_dict())
        self._from_start = stream_state is None
        self._documents = documents  # read so far in this epoch, so an error can say which one
        self._tokens_this_epoch = 0

    def _read(self) -> None:
        texts = []
        for text in self._iter:
            texts.append(text)
            if len(texts) == self.DOCS_PER_READ:
                break
        # The saved position must match the tokens now buffered: take it right after the documents were read.
        self._stream_state = copy.deepcopy(self._dataset.state_dict())
        if not texts:
            if self._from_start and self._tokens_this_epoch < self.seq_len + 1:
                # Like the builtin loader: a window must fit, or every batch would repeat the same few tokens.
                raise UsageError(f"--data {self.spec}: {self._tokens_this_epoch} tokens in all"
                                 f"{' (no documents)' if not self._documents else ''}, less than one window of "
                                 f"--seq-len + 1 = {self.seq_len + 1}; use a shorter --seq-len or more data")
            self.epoch += 1
            self._start_epoch(None, 0)
            return
        self._documents += len(texts)
        for ids in self.tokenizer.encode_documents(texts):
            self.buffer.extend(ids)
            self._tokens_this_epoch += len(ids)

    def _next_window(self) -> Tensor:
        while len(self.buffer) < self.seq_len + 1:
            self._read()
        window = torch.tensor(self.buffer[:self.seq_len + 1])
        del self.buffer[:self.seq_len]  # the last target is the next window's first input
        return window

    def describe(self) -> str:
        return f"{self.spec} streamed in order, packed into windows of {self.seq_len + 1}, no padding"

    def state_dict(self) -> dict:
        return {"kind": "streamed", "epoch": self.epoch, "stream": self._stream_state, "buffer": list(self.buffer),
                "documents": self._documents}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.buffer = state["epoch"], list(state["buffer"])
        self._start_epoch(state["stream"], state.get("documents", 0))


# ----------------------------------------------------------------------------------------------------------
# Entry points for the training scripts

def builtin_tokens(tokenizer, cache_dir: str) -> tuple[Tensor, Tensor]:
    """The builtin corpus as one int32 token stream and its per-document lengths, tokenized once and cached."""
    vocab = json.dumps(tokenizer.backend.get_vocab(), sort_keys=True) + tokenizer.bos + tokenizer.eos
    key = hashlib.sha256(f"v1|{_source_fingerprint('builtin')}|{vocab}".encode()).hexdigest()[:16]
    path = os.path.join(cache_dir, f"builtin-{key}.pt")
    if not os.path.isfile(path):
        docs = tokenizer.encode_documents(list(iter_documents("builtin")))
        tokens = torch.tensor([t for d in docs for t in d], dtype=torch.int32)
        lengths = torch.tensor([len(d) for d in docs], dtype=torch.int64)
        _atomic_write(path, lambda tmp: torch.save({"tokens": tokens, "lengths": lengths}, tmp))
    cached = torch.load(path, weights_only=True)
    return cached["tokens"], cached["lengths"]


def prepare(spec: str, tokenizer_path: str | None, vocab_size: int, cache_dir: str):
    """Build every cache the loaders need. Run it on one process per machine before the others start reading."""
    tokenizer = get_tokenizer(spec, tokenizer_path, vocab_size, cache_dir)
    if spec == "builtin":
        builtin_tokens(tokenizer, cache_dir)
    return tokenizer


HELD_OUT_SHARE = 0.02  # of the builtin corpus: its last documents, never trained on, for --eval-every


def builtin_split(tokens: Tensor, lengths: Tensor) -> tuple[Tensor, Tensor]:
    """The builtin corpus as (training tokens, held-out tokens). The held-out part is the last documents, about
    HELD_OUT_SHARE of the tokens, cut at a document boundary so that no document is in both."""
    starts = torch.cumsum(lengths, 0) - lengths
    boundary = int(starts[starts >= len(tokens) * (1 - HELD_OUT_SHARE)][0])
    return tokens[:boundary], tokens[boundary:]


def eval_spec(args) -> str | None:
    """Where held-out batches come from: --eval-data, else the builtin corpus's held-out part; None when the
    run evaluates nothing (no --eval-every, and --steps is not 0)."""
    if args.eval_every == 0 and args.steps > 0:
        return None
    return args.eval_data or ("builtin" if args.data == "builtin" else None)


def setup(args, local_rank: int, needs_batches: bool):
    """The tokenizer on every rank, and a loader on the ranks that need batches (first stage: inputs, last
    stage: targets; middle stages read nothing).

    One process per machine builds the caches (tokenizer training, tokenized corpus) while the others wait,
    then every rank reads them. Collective: call it on every rank; a problem any rank finds stops them all.
    """
    with collective_errors():  # also the barrier the other processes of a machine wait in
        if local_rank == 0:
            prepare(args.data, args.tokenizer, args.vocab_size or VOCAB_SIZE, args.cache_dir)
    loader = None
    with collective_errors():
        tokenizer = prepare(args.data, args.tokenizer, args.vocab_size or VOCAB_SIZE, args.cache_dir)
        if needs_batches:  # reads the first window now, so a source too small for one fails here
            loader = make_loader(args.data, tokenizer, args.seq_len, args.batch_size, args.seed, args.cache_dir)
            if eval_spec(args) is not None:  # the held-out batches too, once, so they cannot fail mid-run
                held_out = make_loader(eval_spec(args), tokenizer, args.seq_len, args.batch_size, 0, args.cache_dir,
                                       held_out=True)
                if isinstance(held_out, ShuffledWindows) and held_out.num_windows < args.eval_batches * args.batch_size:
                    raise UsageError(f"--eval-batches {args.eval_batches}: the builtin held-out part has "
                                     f"{held_out.num_windows} windows of --seq-len + 1, fewer than --eval-batches x "
                                     f"--batch-size; lower --eval-batches or give --eval-data")
    return tokenizer, loader


def make_loader(spec: str, tokenizer, seq_len: int, batch_size: int, seed: int, cache_dir: str,
                held_out: bool = False):
    """Batches from a --data spec: builtin's training part (held_out: its held-out part, in a fixed order), or
    a streamed source from its start."""
    pad_id = tokenizer.pad_id
    if spec == "builtin":
        train, rest = builtin_split(*builtin_tokens(tokenizer, cache_dir))
        return ShuffledWindows(rest if held_out else train, seq_len, batch_size, seed, pad_id)
    return StreamedWindows(spec, tokenizer, seq_len, batch_size, pad_id)


def padded_useful_share(doc_lengths: Tensor, seq_len: int) -> float:
    """Share of target positions holding text if every document were padded/cut to seq_len, as the seed does."""
    useful = (doc_lengths.clamp(max=seq_len + 1) - 1).sum().item()
    return useful / (len(doc_lengths) * seq_len)

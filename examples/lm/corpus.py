"""The text the language model learns: bytes of real files, a fixed held-out split, fixed batches.

The default corpus is the Python standard library's own ``*.py`` files
(``sysconfig.get_paths()["stdlib"]``): real text that nobody here wrote and that every machine has
offline. ``--corpus PATH`` takes a file or a directory of text files instead.

Choices, and why:

- Byte level (vocabulary 256, no tokenizer): nothing to download or train, and bits per byte
  compare across any text.
- Files are listed recursively in sorted order of their relative POSIX paths, skipping
  ``site-packages``/``dist-packages`` (what is installed, not the library) and ``__pycache__``.
  Files that are not valid UTF-8 are *skipped*, not decoded with replacement characters: in the
  standard library they are the few deliberately mis-encoded test inputs (4 of 1,790 files in
  CPython 3.11), and a replacement character would put bytes into the corpus that no file has.
  The skipped paths are kept in :attr:`Corpus.skipped`; empty files (many ``__init__.py``) add
  nothing and are left out of the list.
- The held-out split is by file and depends on nothing but the relative path: a file is held out
  when the first 8 bytes of the SHA-256 of its path, as a fraction of 2**64, fall below
  :data:`VAL_FRACTION` (5%). So the split never changes with a seed, a world size or another file
  being added. A directory in which no path falls there (a few files) holds out the one file
  with the smallest such value; a single file holds out its last 5% of bytes.
- :attr:`Corpus.list_hash` hashes the list of files used with their sizes: runs on another Python
  version (another standard library) are told apart instead of silently compared.
- Batches are a pure function of ``(seed, rank, world_size, step)`` and the split (:data:`SPLITS`):
  ``"shuffle"`` (the default, as users feed data: torch's ``DistributedSampler`` shuffles the whole
  dataset, then gives each rank its part) draws the step's *global* batch of windows of
  ``context + 1`` bytes from the whole training text with a generator seeded from ``(seed, step)``,
  and rank ``r`` takes its ``r``-th slice: every rank sees the same distribution, and the global
  batch of a step is the same whatever the number of workers. ``"shard"`` (the heterogeneous
  stress case) gives each rank its own contiguous shard (``1/world_size``) of the training bytes,
  the files in alphabetical order: each worker trains on different modules, and decentralized
  methods pay for that heterogeneity. Windows may cross a file boundary (the files are
  concatenated as they are).
"""

from __future__ import annotations

import hashlib
import os
import sysconfig
from dataclasses import dataclass, field
from typing import List, Optional, Sequence, Tuple

import torch
from torch import Tensor

__all__ = ["VAL_FRACTION", "SPLITS", "Corpus", "stdlib_root", "list_files", "is_validation", "split_files",
           "load_corpus", "train_batch", "val_windows"]

#: share of the files (by the hash of their path) held out for validation
VAL_FRACTION = 0.05
#: how the training text is split over the ranks (see the module): the whole text shuffled, or one
#: contiguous shard per rank
SPLITS = ("shuffle", "shard")
#: directories never read: installed packages and bytecode caches are not the standard library
SKIP_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__"})


@dataclass(frozen=True)
class Corpus:
    """The training and validation bytes (uint8 tensors) and what they were made of."""

    name: str  # "python-stdlib-3.11" or the path given
    root: str
    train: Tensor
    val: Tensor
    train_files: Tuple[str, ...]
    val_files: Tuple[str, ...]
    list_hash: str
    skipped: Tuple[str, ...] = field(default=())  # not UTF-8: left out

    @property
    def n_bytes(self) -> int:
        """Bytes in the corpus (training + validation)."""
        return int(self.train.numel() + self.val.numel())

    def describe(self) -> str:
        """One line for logs: where, how much, which list (its hash)."""
        return (f"corpus {self.name} ({self.root}): {self.n_bytes:,} bytes in "
                f"{len(self.train_files) + len(self.val_files)} files ({len(self.val_files)} held out, "
                f"{self.val.numel():,} bytes), file-list hash {self.list_hash}"
                + (f", {len(self.skipped)} non-UTF-8 files skipped" if self.skipped else ""))


def stdlib_root() -> str:
    """This interpreter's standard library directory."""
    return sysconfig.get_paths()["stdlib"]


def list_files(root: str, suffix: str = "") -> List[str]:
    """Relative POSIX paths of the regular files under ``root`` ending in ``suffix``, sorted;
    :data:`SKIP_DIRS` and hidden directories are not entered, symbolic links not followed."""
    out = []
    for dirpath, dirnames, filenames in os.walk(root, followlinks=False):
        dirnames[:] = [d for d in dirnames if d not in SKIP_DIRS and not d.startswith(".")]
        for name in filenames:
            full = os.path.join(dirpath, name)
            if name.endswith(suffix) and not name.startswith(".") and os.path.isfile(full) \
                    and not os.path.islink(full):
                out.append(os.path.relpath(full, root).replace(os.sep, "/"))
    return sorted(out)


def _path_fraction(rel: str) -> float:
    """Where ``rel``'s SHA-256 falls in [0, 1): the split's only input."""
    return int.from_bytes(hashlib.sha256(rel.encode("utf-8")).digest()[:8], "big") / 2.0 ** 64


def is_validation(rel: str, fraction: float = VAL_FRACTION) -> bool:
    """Whether the file at relative path ``rel`` is held out (see the module docstring)."""
    return _path_fraction(rel) < fraction


def split_files(files: Sequence[str], fraction: float = VAL_FRACTION) -> Tuple[List[str], List[str]]:
    """(training files, held-out files), each in the order given. With two or more files and none
    held out by the hash, the one with the smallest hash value is."""
    val = [f for f in files if is_validation(f, fraction)]
    if not val and len(files) >= 2:
        val = [min(files, key=_path_fraction)]
    held = set(val)
    return [f for f in files if f not in held], val


def _list_hash(entries: Sequence[Tuple[str, int]]) -> str:
    h = hashlib.sha256()
    for rel, size in entries:
        h.update(f"{rel}\t{size}\n".encode("utf-8"))
    return h.hexdigest()[:16]


def _read_utf8(path: str) -> Optional[bytes]:
    """The file's bytes, or None when they are not valid UTF-8."""
    with open(path, "rb") as f:
        data = f.read()
    try:
        data.decode("utf-8")
    except UnicodeDecodeError:
        return None
    return data


def _as_tensor(chunks: Sequence[bytes]) -> Tensor:
    joined = b"".join(chunks)
    if not joined:
        return torch.empty(0, dtype=torch.uint8)
    return torch.frombuffer(bytearray(joined), dtype=torch.uint8)


def load_corpus(path: Optional[str] = None) -> Corpus:
    """The standard library's ``*.py`` files (``path`` None), every text file under a directory, or
    one file, as in-memory bytes split into training and validation (module docstring)."""
    if path is None:
        root, suffix = stdlib_root(), ".py"
        v = sysconfig.get_python_version()
        name = f"python-stdlib-{v}"
    else:
        root, suffix, name = os.path.abspath(path), "", path
        if not os.path.exists(root):
            raise FileNotFoundError(f"--corpus {path!r}: no such file or directory (give a text file or a "
                                    "directory of text files; leave it out for the Python standard library)")
    if os.path.isfile(root):
        data = _read_utf8(root)
        if not data:
            raise ValueError(f"--corpus {path!r}: {'empty' if data is not None else 'not UTF-8 text'}")
        cut = len(data) - max(1, int(len(data) * VAL_FRACTION))
        rel = os.path.basename(root)
        return Corpus(name, root, _as_tensor([data[:cut]]), _as_tensor([data[cut:]]), (rel,), (rel,),
                      _list_hash([(rel, len(data))]))
    files = list_files(root, suffix)
    texts, kept, skipped = {}, [], []
    for rel in files:
        data = _read_utf8(os.path.join(root, rel))
        if data is None:
            skipped.append(rel)
        elif data:
            texts[rel] = data
            kept.append(rel)
    if not kept:
        raise ValueError(f"corpus {name!r} ({root}): no non-empty UTF-8 file{' ending in ' + suffix if suffix else ''}"
                         f" found ({len(skipped)} not UTF-8)")
    train_files, val_files = split_files(kept)
    if not train_files:
        raise ValueError(f"corpus {name!r} ({root}): only one file ({kept[0]}); give a directory of several "
                         "files, or the file itself (then its last 5% of bytes are held out)")
    return Corpus(name, root, _as_tensor([texts[f] for f in train_files]), _as_tensor([texts[f] for f in val_files]),
                  tuple(train_files), tuple(val_files), _list_hash([(f, len(texts[f])) for f in kept]),
                  tuple(skipped))


def _step_seed(seed: int, rank: int, world_size: int, step: int) -> int:
    key = f"{seed}:{rank}:{world_size}:{step}".encode("ascii")
    return int.from_bytes(hashlib.sha256(key).digest()[:8], "big") >> 1  # manual_seed takes < 2**63


def train_batch(train: Tensor, seed: int, rank: int, world_size: int, step: int, batch_size: int,
                context: int, split: str = "shuffle") -> Tuple[Tensor, Tensor]:
    """Inputs and next-byte targets, both ``(batch_size, context)`` int64, for this rank and step.

    A pure function of its arguments (a step's batch never depends on the steps before it).
    ``split="shuffle"``: the step's global batch (``batch_size x world_size`` windows) is drawn from
    the whole of ``train`` by a generator seeded from ``(seed, step)``, and this rank takes its slice
    of it. ``split="shard"``: rank ``r`` reads only its shard ``r`` of ``world_size`` contiguous equal
    shards of ``train``, at positions drawn by a generator seeded from ``(seed, rank, world_size,
    step)``.
    """
    if not 0 <= rank < world_size:
        raise ValueError(f"rank must be in [0, world_size={world_size}), got {rank}")
    if split not in SPLITS:
        raise ValueError(f"split must be one of {', '.join(map(repr, SPLITS))}, got {split!r}")
    if split == "shuffle":
        if train.numel() < context + 2:
            raise ValueError(f"the training text has {train.numel():,} bytes, fewer than context + 2 = "
                             f"{context + 2}: use a larger corpus or a shorter context")
        g = torch.Generator().manual_seed(_step_seed(seed, -1, 0, step))  # one draw for every rank
        starts = torch.randint(0, train.numel() - context, (batch_size * world_size,), generator=g)
        starts = starts[rank * batch_size:(rank + 1) * batch_size]
    else:
        shard = train.numel() // world_size
        if shard < context + 2:
            raise ValueError(f"the training text ({train.numel():,} bytes) split over {world_size} ranks gives "
                             f"{shard:,} bytes each, fewer than context + 2 = {context + 2}: use a larger corpus "
                             "or a shorter context")
        g = torch.Generator().manual_seed(_step_seed(seed, rank, world_size, step))
        starts = torch.randint(0, shard - context, (batch_size,), generator=g) + rank * shard
    idx = starts[:, None] + torch.arange(context + 1)
    windows = train[idx].long()
    return windows[:, :-1], windows[:, 1:]


def val_windows(val: Tensor, context: int, count: int) -> Tensor:
    """The fixed validation slice: ``count`` windows of ``context + 1`` bytes, evenly spaced over
    the held-out bytes (int64, ``(count, context + 1)``); the same for every run on this corpus."""
    if val.numel() < context + 1:
        raise ValueError(f"the held-out text has {val.numel():,} bytes, fewer than context + 1 = {context + 1}")
    if count < 1:
        raise ValueError(f"count must be >= 1 validation windows, got {count}")
    starts = torch.linspace(0, val.numel() - context - 1, count).round().long()
    return val[starts[:, None] + torch.arange(context + 1)].long()

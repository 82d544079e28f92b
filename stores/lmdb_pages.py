"""Whether an LMDB data file still holds every page that its current snapshot reads.

`LmdbRecords` calls `check_pages` when data.mdb is shorter than the snapshot's last page number says:
LMDB counts pages that it allocated and freed inside one write transaction, or that lie free at the file's
end, without ever writing them, so a short file is not yet a damaged one. Only a page that the B-trees reach
(branch, leaf and overflow pages of the free-page and main databases and of any sub-database) must lie
inside the file: reading one that does not through the memory map kills the process with SIGBUS.

The walk reads pages with `os.pread`, never through the map, so it cannot fault itself, and holds a read
transaction meanwhile, so that no writer reuses the pages of the snapshot it walks.

Layout (liblmdb `mdb.c`, 64-bit builds, host byte order): each page starts with a 16-byte header (pgno u64,
pad u16, flags u16, then lower u16 and upper u16, or an overflow run's page count u32), followed on branch
and leaf pages by u16 offsets of nodes, each with an 8-byte header (lo u16, hi u16, flags u16, key size
u16); a branch node's child is lo | hi << 16 | flags << 32. Meta pages 0 and 1 hold, after the page header,
magic, version, address, map size, the free-page and main databases (48 bytes each: pad u32, flags u16,
depth u16, branch, leaf and overflow page counts, entries, root), last page and transaction id; a read
transaction with id N reads meta page N % 2.
"""

from __future__ import annotations

import os
import struct
import threading
from typing import NamedTuple

import lmdb

from ..errors import StoreError

PAGE_HEADER = struct.Struct("=QHHHH")  # pgno, pad, flags, lower, upper
OVERFLOW_HEADER = struct.Struct("=QHHI")  # pgno, pad, flags, pages in the run
NODE_HEADER = struct.Struct("=HHHH")  # lo, hi, flags, key size
DATABASE = struct.Struct("=IHHQQQQQ")  # pad, flags, depth, branch/leaf/overflow pages, entries, root
META = struct.Struct("=II16x48s48sQQ")  # magic, version, (address, map size), free db, main db, last page, txnid
PGNO = struct.Struct("=Q")

P_BRANCH, P_LEAF, P_OVERFLOW, P_META, P_LEAF2 = 0x01, 0x02, 0x04, 0x08, 0x20
PAGE_KINDS = P_BRANCH | P_LEAF | P_OVERFLOW | P_META
F_BIGDATA, F_SUBDATA, F_DUPDATA = 0x01, 0x02, 0x04
MDB_MAGIC = 0xBEEFC0DE
NO_PAGE = (1 << 64) - 1  # the root of an empty tree
_META_TRIES = 8  # a writer may overwrite the snapshot's meta page between `begin` and reading it


class _Tree(NamedTuple):
    """A B-tree to walk. `duplicates`: its leaves hold only the values of one duplicate key (no records)."""

    root: int
    depth: int
    name: str
    duplicates: bool = False


class DataFileWatch:
    """Refuses transactions, with StoreError, while data.mdb lacks pages that LMDB would read through its
    memory map; opened with the environment, `check`ed before each of its transactions.

    LMDB data files never shrink, so while the file is as long as the longest it was seen, `check` costs one
    system call (about 0.3 µs); a shorter file was truncated, and gets the full page walk (`check_pages`),
    repeated only when its size or the last committed transaction changes.
    """

    def __init__(self, env: lmdb.Environment, directory: str) -> None:
        self.env, self.where = env, directory
        self.fd = os.open(os.path.join(directory, "data.mdb"), os.O_RDONLY | os.O_CLOEXEC)
        self._lock = threading.Lock()
        self._refused: tuple[int, int, str] | None = None  # file size and last txnid when refused, and why
        try:
            needed = (env.info()["last_pgno"] + 1) * env.stat()["psize"]
            self._longest = self._size()  # read after LMDB's page count: the file only ever grows
            if self._longest < needed:  # perhaps pages LMDB counts but never wrote: walk to see
                check_pages(env, self.fd, directory)
        except BaseException:
            os.close(self.fd)
            raise

    def check(self) -> None:
        """StoreError if the file shrank and lacks pages that the current snapshot reaches."""
        size = self._size()
        if size >= self._longest:
            self._longest = size
        else:
            self._shrunk(size)

    def close(self) -> None:
        os.close(self.fd)

    def _size(self) -> int:
        return os.lseek(self.fd, 0, os.SEEK_END)  # the size, without fstat's result object (a third the cost)

    def _shrunk(self, size: int) -> None:
        with self._lock:
            state = (size, self.env.info()["last_txnid"])
            if self._refused is not None and self._refused[:2] == state:
                raise StoreError(self._refused[2])
            try:
                check_pages(self.env, self.fd, self.where)
            except StoreError as error:
                self._refused = (*state, str(error))
                raise
            self._refused = None
            self._longest = size  # whole at this size: the new baseline


def check_pages(env: lmdb.Environment, fd: int, where: str) -> None:
    """StoreError if the current snapshot of `env` reaches a page beyond the end of its data file (open at
    `fd`), or a page that is not what its parent says (damage); the message names the page."""
    page_size = env.stat()["psize"]
    for _ in range(_META_TRIES):
        with env.begin(buffers=True) as txn:  # holds the snapshot's pages against reuse while they are read
            trees = _snapshot_trees(fd, page_size, txn.id(), where)
            if trees:
                _Walk(fd, page_size, os.fstat(fd).st_size, where).trees(trees)
                return
    raise damaged(where, "its meta pages kept changing while they were read")


def damaged(where: str, problem: str) -> StoreError:
    """The StoreError for a damaged data file: what, why, what to do."""
    return StoreError(f"LMDB store at {where!r} is damaged: data.mdb {problem}; restore it from a copy, or "
                      "delete the directory")


def _snapshot_trees(fd: int, page_size: int, txnid: int, where: str) -> list[_Tree]:
    """The free-page and main databases of transaction `txnid`'s snapshot, from meta page txnid % 2; none if
    a later writer overwrote that page meanwhile."""
    meta_pgno = txnid % 2
    page = os.pread(fd, PAGE_HEADER.size + META.size, meta_pgno * page_size)
    if len(page) < PAGE_HEADER.size + META.size:
        raise damaged(where, f"is too short for meta page {meta_pgno}")
    stored_pgno, _pad, flags, _lower, _upper = PAGE_HEADER.unpack_from(page)
    magic, _version, free_db, main_db, _last_pgno, stored_txnid = META.unpack_from(page, PAGE_HEADER.size)
    if stored_pgno != meta_pgno or flags & PAGE_KINDS != P_META or magic != MDB_MAGIC:
        raise damaged(where, f"has no valid meta page {meta_pgno} (it names page {stored_pgno}, flags "
                             f"{flags:#x}, magic {magic:#x})")
    if stored_txnid > txnid:
        return []
    if stored_txnid < txnid:
        raise damaged(where, f"has meta page {meta_pgno} of transaction {stored_txnid}, not {txnid}")
    return [_tree(free_db, "the free-page database"), _tree(main_db, "the main database")]


def _tree(packed: bytes, name: str, duplicates: bool = False) -> _Tree:
    _pad, _flags, depth, _branch, _leaf, _overflow, _entries, root = DATABASE.unpack(packed)
    return _Tree(root, depth, name, duplicates)


class _Walk:
    """One walk over the pages of a snapshot's trees, level by level; raises at the first bad page."""

    def __init__(self, fd: int, page_size: int, file_size: int, where: str) -> None:
        self.fd, self.page_size, self.file_size, self.where = fd, page_size, file_size, where
        self.seen: set[int] = set()

    def trees(self, trees: list[_Tree]) -> None:
        """Walk `trees` and every sub-database their leaves name."""
        while trees:
            tree = trees.pop()
            level = [tree.root] if tree.root != NO_PAGE else []
            for depth in range(1, tree.depth + 1):
                kind = P_LEAF if depth == tree.depth else P_BRANCH
                children: list[int] = []
                for pgno in level:
                    page = self._page(pgno, kind, f"a {'leaf' if kind == P_LEAF else 'branch'} page of {tree.name}")
                    if kind == P_BRANCH:
                        children += self._children(pgno, page)
                    elif not (tree.duplicates or PAGE_HEADER.unpack_from(page)[2] & P_LEAF2):
                        trees += self._leaf(pgno, page, tree.name)
                level = children
            if level:
                raise damaged(self.where, f"has pages of {tree.name} below its recorded depth {tree.depth}")

    def _page(self, pgno: int, kind: int, what: str) -> bytes:
        """Page `pgno`, checked to be a `kind` page, inside the file and reached once."""
        self._once(pgno, what)
        self._inside(pgno, 1, what)
        page = os.pread(self.fd, self.page_size, pgno * self.page_size)
        stored_pgno, _pad, flags, _lower, _upper = PAGE_HEADER.unpack_from(page)
        self._check_header(pgno, stored_pgno, flags, kind, what)
        return page

    def _once(self, pgno: int, what: str) -> None:
        """Damage if page `pgno` was reached before: every page belongs to one tree node (else a cycle)."""
        if pgno in self.seen:
            raise damaged(self.where, f"reaches page {pgno} ({what}) twice")
        self.seen.add(pgno)

    def _inside(self, pgno: int, count: int, what: str) -> None:
        """Damage if the run of `count` pages from `pgno` does not lie wholly inside the file."""
        end = (pgno + count) * self.page_size
        if end > self.file_size:
            pages = f"pages {pgno}-{pgno + count - 1}" if count > 1 else f"page {pgno}"
            raise damaged(self.where, f"is missing {pages} ({what}): the file ends at {self.file_size} bytes, "
                                      f"not {end}; it was truncated")

    def _check_header(self, pgno: int, stored_pgno: int, flags: int, kind: int, what: str) -> None:
        if stored_pgno != pgno or flags & PAGE_KINDS != kind:
            raise damaged(self.where, f"has garbage in page {pgno} ({what}): it names page {stored_pgno} with "
                                      f"flags {flags:#x}")

    def _nodes(self, pgno: int, page: bytes) -> list[tuple[int, int, int, int, int]]:
        """(offset, lo, hi, flags, key size) of each node of a branch or leaf page."""
        _pgno, _pad, _flags, lower, upper = PAGE_HEADER.unpack_from(page)
        if not PAGE_HEADER.size <= lower <= upper <= self.page_size or (lower - PAGE_HEADER.size) % 2:
            raise damaged(self.where, f"has garbage in page {pgno}: free space from {lower} to {upper}")
        nodes = []
        for offset in struct.unpack_from(f"={(lower - PAGE_HEADER.size) // 2}H", page, PAGE_HEADER.size):
            if not upper <= offset <= self.page_size - NODE_HEADER.size:
                raise damaged(self.where, f"has garbage in page {pgno}: a node at offset {offset}")
            lo, hi, flags, key_size = NODE_HEADER.unpack_from(page, offset)
            nodes.append((offset, lo, hi, flags, key_size))
        return nodes

    def _children(self, pgno: int, page: bytes) -> list[int]:
        return [lo | hi << 16 | flags << 32 for _offset, lo, hi, flags, _key_size in self._nodes(pgno, page)]

    def _leaf(self, pgno: int, page: bytes, tree_name: str) -> list[_Tree]:
        """Check the overflow runs that the records of leaf page `pgno` name; return its sub-databases."""
        subdatabases = []
        for offset, lo, hi, flags, key_size in self._nodes(pgno, page):
            data = offset + NODE_HEADER.size + key_size
            size = PGNO.size if flags & F_BIGDATA else DATABASE.size if flags & F_SUBDATA else lo | hi << 16
            if data + size > self.page_size:
                raise damaged(self.where, f"has garbage in page {pgno}: a record runs past the page's end")
            if flags & F_BIGDATA:
                self._overflow(PGNO.unpack_from(page, data)[0], f"a record's overflow pages in {tree_name}")
            elif flags & F_SUBDATA:
                subdatabases.append(_tree(page[data:data + DATABASE.size], f"a sub-database named in page {pgno}",
                                          duplicates=bool(flags & F_DUPDATA)))
        return subdatabases

    def _overflow(self, first: int, what: str) -> None:
        """Check the run of overflow pages that starts at page `first`: its header, and that it is whole."""
        self._once(first, what)
        self._inside(first, 1, what)
        stored_pgno, _pad, flags, count = OVERFLOW_HEADER.unpack(
            os.pread(self.fd, OVERFLOW_HEADER.size, first * self.page_size))
        self._check_header(first, stored_pgno, flags, P_OVERFLOW, what)
        if count == 0:
            raise damaged(self.where, f"has garbage in page {first} ({what}): a run of no pages")
        self._inside(first, count, what)

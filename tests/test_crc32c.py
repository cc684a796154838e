"""The NVMe tier's checksum through the binding (K.crc32c, offload_adam/nvme/direct_io.py's
crc32): CRC32C, the same number on every variant and for every kind of buffer the tier
hands it (memoryview slices of an mmap, bytes), and changed by a flipped bit anywhere.
The C++ tests (tests/cpp/test_crc32c.cpp) check every variant against the bitwise
reference on every length and alignment."""
import random
import threading

import pytest
import torch

from offload_adam.nvme import direct_io
from offload_adam.nvme.direct_io import AlignedBuffer


def crc32c_bitwise(data: bytes, crc: int = 0) -> int:
    """The definition (csrc/crc32c.h): reflected, polynomial 0x82F63B78, complemented."""
    c = crc ^ 0xFFFFFFFF
    for b in data:
        c ^= b
        for _ in range(8):
            c = (c >> 1) ^ (0x82F63B78 & -(c & 1))
    return c ^ 0xFFFFFFFF


@pytest.fixture
def each_variant(kernels):
    """Runs the test body once per variant this CPU supports (set in process: the
    checksum reads the active variant at each call)."""
    active = kernels.isa()

    def run(body):
        for isa in kernels.supported_isas():
            kernels.set_isa(isa)
            body(isa)
    try:
        yield run
    finally:
        kernels.set_isa(active)


def test_known_vectors_and_the_reference(kernels, each_variant):
    rng = random.Random(0)
    samples = [(b"123456789", 0xE3069283), (bytes(32), 0x8A9136AA), (b"\xff" * 32, 0x62A8AB43),
               (bytes(range(32)), 0x46DD794E), (b"", 0)]
    samples += [(bytes(rng.getrandbits(8) for _ in range(n)), None) for n in range(0, 80, 3)]

    def check(isa):
        for data, want in samples:
            ref = crc32c_bitwise(data)
            assert want is None or ref == want
            assert direct_io.crc32(data) == ref, (isa, len(data))
            assert kernels.crc32c(data[5:], kernels.crc32c(data[:5])) == ref, (isa, len(data))
    each_variant(check)


def test_every_variant_and_every_buffer_give_one_number(kernels, each_variant):
    n = (4 << 20) + 4096
    buf = AlignedBuffer(n, pin=False)
    try:
        buf.tensor.random_(0, 256, generator=torch.Generator().manual_seed(1))
        cuts = [(0, 4 << 20), (1, 4097), (4096, n), (3, 24 * 1024 + 11), (7, 7), (100, 100 + 1000003)]
        found = {}

        def check(isa):
            for a, b in cuts:
                view = buf.view[a:b]
                sums = {direct_io.crc32(view), direct_io.crc32(bytes(view)),
                        direct_io.crc32(bytearray(view)), kernels.crc32c(view)}
                assert len(sums) == 1, (isa, a, b, sums)
                found.setdefault((a, b), set()).add(sums.pop())
        each_variant(check)
        assert all(len(s) == 1 for s in found.values()), found
        assert crc32c_bitwise(bytes(buf.view[1:4097])) in found[(1, 4097)]
    finally:
        buf.close()


def test_a_flipped_bit_anywhere_changes_it(kernels, each_variant):
    n = 4 << 20   # a request
    buf = AlignedBuffer(n, pin=False)
    try:
        buf.tensor.random_(0, 256, generator=torch.Generator().manual_seed(2))
        rng = random.Random(3)
        bits = [0, 7, 8 * n - 1, 8 * 8192 * 3 - 1, 8 * 8192 * 3] + [rng.randrange(8 * n)
                                                                  for _ in range(40)]

        def check(isa):
            base = direct_io.crc32(buf.view)
            for bit in bits:
                buf.view[bit // 8] ^= 1 << (bit % 8)
                assert direct_io.crc32(buf.view) != base, (isa, bit)
                buf.view[bit // 8] ^= 1 << (bit % 8)
            assert direct_io.crc32(buf.view) == base
        each_variant(check)
    finally:
        buf.close()


def test_threads_checksum_at_once(kernels):
    """The I/O threads run it in parallel (the GIL released): the same numbers."""
    datas = [bytes(random.Random(k).getrandbits(8) for _ in range(1 << 16)) * 16 for k in range(4)]
    want = [direct_io.crc32(d) for d in datas]
    got = [None] * 16

    def work(i):
        got[i] = direct_io.crc32(memoryview(datas[i % 4]))
    threads = [threading.Thread(target=work, args=(i,)) for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert got == want * 4


def test_what_is_not_a_contiguous_buffer_is_refused(kernels):
    with pytest.raises(TypeError, match="bytes-like"):
        direct_io.crc32("123456789")
    with pytest.raises(BufferError):
        direct_io.crc32(memoryview(b"123456789")[::2])

# the fp16/bf16 argument's parts, one thread, 10M entries: a bare cast, a cast into a preallocated buffer,
# the wire's body checksum (CRC-32 + CRC-32C) of the 20 MB result; medians of 21 after 2 warm-up calls
import time, statistics, torch, gradcomp
gradcomp.keep_freed_memory()
torch.set_num_threads(1)
from gradcomp.wire.checksum import checksum64, CRC32_IMPLEMENTATION, CRC32C_IMPLEMENTATION
x = torch.randn(10_000_000, generator=torch.Generator().manual_seed(0))
def t(fn, n=21):
    fn(); fn(); out = []
    for _ in range(n):
        s = time.perf_counter(); fn(); out.append(time.perf_counter() - s)
    return statistics.median(out) * 1000
print("crc32:", CRC32_IMPLEMENTATION, "crc32c:", CRC32C_IMPLEMENTATION)
for dt in (torch.float16, torch.bfloat16):
    buf = torch.empty(10_000_000, dtype=dt); body = x.to(dt).view(torch.uint8)
    a = t(lambda: x.to(dt)); b = t(lambda: buf.copy_(x)); c = t(lambda: checksum64(body))
    print(f"{str(dt)[6:]}: bare cast {a:.2f} ms; cast into a buffer {b:.2f} ms ({b/a:.2f} cast); checksum of the "
          f"20 MB body {c:.2f} ms ({c/a:.2f} cast); buffer + checksum {(b+c)/a:.2f} cast")

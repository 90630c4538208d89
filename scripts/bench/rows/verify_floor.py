"""The note the load and init rows add where verify costs more than half the load."""

VERIFY_GOAL = 0.5  # verify / load

VERIFY_FLOOR = (
    "Where verify misses 0.5× the load: verify must read every byte twice over, once where it "
    "landed and once in rank 0's source, which only rank 0 holds. Every rank checksums its own "
    "shards (fsdpcheck/model/checksum.py: weighted row and column sums of a grid of 64-bit words, "
    "and the same of the words read 4 bytes on, block by cache-sized block; the digests row "
    "measures its speed); meanwhile rank 0 checksums the other ranks' slices of its source (the "
    "audit does that on a thread while the load sends them, fsdpcheck/loader/verify.py "
    "`expect_ahead`, so the init row's load stage holds that work; the full load row's verify_load"
    " does it after the load, before the gather) and compares its own shards with its source "
    "bitwise on a second thread. So on 2 ranks rank 0 reads 1.5× the model where the load writes "
    "0.5× into each rank, and the streams share the host's 2 cores: the ratio moves with how fast "
    "the load happened to be (rank 1's page faults, see below). The full load row measures, after "
    "each verify, the floor of any verify: each rank reading once what it must (rank 0 the whole "
    "source and its own shards) as plain 64-bit sums, with verify's threads. A plain sum is no "
    "digest (swapped or offsetting words pass it), so verify pays the checksum's three more "
    "reductions per block above that floor, in cache; no single-threaded pass over the whole model"
    " and no host copy remain."
)

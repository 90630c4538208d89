"""The note the load and init rows add where verify costs more than half the load."""

VERIFY_GOAL = 0.5  # verify / load

VERIFY_FLOOR = (
    "Where verify misses 0.5× the load: verify must read every byte twice over, once where it "
    "landed and once in rank 0's source, which only rank 0 holds. Every rank checksums its own "
    "shards (fsdpcheck/model/checksum.py: weighted row and column sums of a grid of 64-bit "
    "words, no multiplication over the data; the digests row measures its speed); meanwhile, "
    "before the "
    "gather, rank 0 checksums the other ranks' slices of its source and compares its own shards "
    "with its source bitwise on a second thread. So on 2 ranks rank 0 reads 1.5× the model "
    "where the load writes 0.5× into each rank, and the three streams share the host's 2 "
    "cores: the ratio moves with how fast the load happened to be (rank 1's page faults, see "
    "below). On a host with more cores each rank's checksum spreads over its share of them. "
    "Profiled: no single-threaded pass over the whole model and no host copy remain; the floor "
    "is rank 0's memory bandwidth over its source."
)

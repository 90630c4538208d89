"""One process of the state-digest benchmark: what the state checks cost on a real-size model.

Builds a config (``--model``, a directory with config.json) the way ``--init rank0`` does on
rank 0 (deterministic fill), then times, each ``--repeats`` times: the layout fingerprint
(buffers digested), the fingerprint with every parameter digested (``--init all`` and
``check_model`` after a load), the same parameters through blake2b on one thread (what the
value digest cost before the checksum), the buffer check against a rebuild from the config
(``uninitialized``), the tie record and the canonical config. Prints one ``@bench {json}`` line.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import time


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    from fsdpcheck.model.build import build
    from fsdpcheck.model.config_record import config_record
    from fsdpcheck.model.fingerprint import fingerprint
    from fsdpcheck.model.resolve import resolve
    from fsdpcheck.model.state import buffer_problems, buffer_reference, tie_record

    start = time.perf_counter()
    built = build(resolve(args.model), rank=0, init="rank0")
    build_s = time.perf_counter() - start
    model = built.model
    params = [p.detach() for p in model.parameters()]
    nbytes = sum(p.numel() * p.element_size() for p in params)

    def timed(fn) -> list[float]:
        out = []
        for _ in range(args.repeats):
            began = time.perf_counter()
            fn()
            out.append(time.perf_counter() - began)
        return out

    def blake2b_all() -> None:
        for p in params:
            flat = p.reshape(-1).contiguous().view(__import__("torch").uint8)
            hashlib.blake2b(flat.numpy().tobytes(), digest_size=16).hexdigest()

    figures = {
        "layout fingerprint": timed(lambda: fingerprint(model, "pre-wrap")),
        "fingerprint + parameter digests": timed(
            lambda: fingerprint(model, "pre-wrap", param_values=True)
        ),
        "blake2b of every parameter (one thread)": timed(blake2b_all),
        "buffers vs a rebuild from the config": timed(
            lambda: buffer_problems(model, "load", buffer_reference(model))
        ),
        "tie record": timed(lambda: tie_record(model, "pre-wrap")),
        "canonical config": timed(lambda: config_record(built.config)),
    }
    record = {
        "build_seconds": build_s,
        "init_values": built.info.init_values,
        "parameter_bytes": nbytes,
        "parameters": sum(p.numel() for p in params),
        "seconds": figures,
    }
    print("@bench " + json.dumps(record), flush=True)


if __name__ == "__main__":
    main()

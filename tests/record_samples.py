"""train.py, recording every training sample it consumes, for the elastic drill (tests/test_restarts.py): one
line `attempt position window` per sample in $TPFRAME_TEST_SAMPLES/<pid>.txt, where position is the sample's
place in the global order and window the token window it read."""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import train  # noqa: E402


def prepare(argv, *, world_size=None, rank=None, device_check=True):  # the launcher's pre-flight: train.py's
    return train.prepare(argv, world_size=world_size, rank=rank, device_check=device_check)


def _record() -> None:
    import numpy as np

    from tpframe.data.loader import BatchIterator

    plain = BatchIterator.next
    out = open(os.path.join(os.environ["TPFRAME_TEST_SAMPLES"], f"{os.getpid()}.txt"), "a")  # noqa: SIM115
    attempt = os.environ.get("TPFRAME_ATTEMPT", "0")

    def next_recorded(self):
        if self.split == "train":
            b = self.micro_batch_size
            positions = self.samples_consumed + self.dp_rank * b + np.arange(b)
            epochs, pos = np.divmod(positions, self.sources[0].num_windows)
            for p, e, w in zip(positions, epochs, pos):
                out.write(f"{attempt} {p} {self.sources[0].order(int(e))[w]}\n")
            out.flush()
        return plain(self)

    BatchIterator.next = BatchIterator.__next__ = next_recorded


if __name__ == "__main__":
    _record()
    sys.exit(train.main())

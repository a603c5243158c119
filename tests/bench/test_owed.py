"""The owed-sum benchmark runs, and refuses a kept sum below the fresh one."""

import pytest

from bench import owed
from proxy.core.commitment import Commitments


def test_the_owed_benchmark_prints_one_row_per_level_and_round(capsys: pytest.CaptureFixture[str]):
    assert owed.main(["--streams", "16,32", "--engines", "2", "--admissions", "20",
                      "--rounds", "2", "--repeat", "1"]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| 16 ")
            or line.startswith("| 32 ")]
    assert len(rows) == 4


def test_the_benchmark_checks_the_bound(monkeypatch: pytest.MonkeyPatch):
    real = Commitments.owed_blocks

    def low(self: Commitments, block: int, bpt: float | None, now: float | None = None) -> float:
        return real(self, block, bpt) * (0.5 if now is not None else 1.0)

    monkeypatch.setattr(Commitments, "owed_blocks", low)
    with pytest.raises(SystemExit, match="fell below"):
        owed.main(["--streams", "16", "--engines", "2", "--admissions", "5", "--rounds", "1",
                   "--repeat", "1"])

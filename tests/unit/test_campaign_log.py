"""The campaign's log is published: it holds paths as configured, not as resolved on the machine that ran it."""

from __future__ import annotations

import sys

from bench.campaign import REPO, Log


def test_the_log_names_paths_as_configured(tmp_path, capsys):
    folder = tmp_path / "runs" / "campaign-x"
    log = Log(folder, "runs/campaign-x")
    log(f"run folder {folder}/curve/abc: 0/8 shards")
    log(f"campaign {REPO}/configs/campaign/smoke.yaml, traceback in {sys.base_prefix}/lib/python3.11/runpy.py")
    log.file.close()
    written = (folder / "campaign.log").read_text()
    assert "run folder runs/campaign-x/curve/abc: 0/8 shards" in written
    assert "campaign configs/campaign/smoke.yaml, traceback in <python>/lib/python3.11/runpy.py" in written
    assert str(tmp_path) not in written and str(REPO) not in written
    assert capsys.readouterr().out.count("runs/campaign-x/curve/abc") == 1  # stdout says the same

"""The `make paper` driver's command line: clear errors for bad input."""

from kvreplay.paper import main


def test_unknown_profile_and_empty_selection_exit_2(capsys):
    assert main(["--profile", "no-such-profile"]) == 2
    assert "unknown profile" in capsys.readouterr().err
    assert main(["--profile", "smoke", "--only", "99"]) == 2
    assert "matches no notebook" in capsys.readouterr().err


def test_up_to_date_notebooks_are_skipped(tmp_path, monkeypatch, capsys):
    from kvreplay import paper

    params = tmp_path / "params"
    params.mkdir()
    (params / "mini.yaml").write_text(f"profile: mini\nledger_root: {tmp_path / 'ledgers'}\n")
    (tmp_path / "ledgers" / "mini").mkdir(parents=True)
    ledger_file = tmp_path / "ledgers" / "mini" / "rows.jsonl"
    ledger_file.write_text("{}\n")
    ran = []

    def fake_run(name, profile, prm, out_dir, html=True, progress=True):
        ran.append(name)
        (out_dir / name).write_text("executed")

    monkeypatch.setattr(paper, "PARAMS", params)
    monkeypatch.setattr(paper, "BUILD", tmp_path / "build")
    monkeypatch.setattr(paper, "run_notebook", fake_run)
    assert paper.main(["--profile", "mini", "--only", "01", "02"]) == 0
    assert len(ran) == 2
    assert paper.main(["--profile", "mini", "--only", "01", "02"]) == 0
    assert len(ran) == 2 and "up to date" in capsys.readouterr().out
    ledger_file.write_text('{"changed": 1}\n')  # a ledger changed: both rerun
    assert paper.main(["--profile", "mini", "--only", "01", "02"]) == 0
    assert len(ran) == 4
    assert paper.main(["--profile", "mini", "--only", "01", "--force"]) == 0
    assert len(ran) == 5

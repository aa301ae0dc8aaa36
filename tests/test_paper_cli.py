"""The `make paper` driver's command line: clear errors for bad input."""

from kvreplay.paper import main


def test_unknown_profile_and_empty_selection_exit_2(capsys):
    assert main(["--profile", "no-such-profile"]) == 2
    assert "unknown profile" in capsys.readouterr().err
    assert main(["--profile", "smoke", "--only", "99"]) == 2
    assert "matches no notebook" in capsys.readouterr().err

"""`python -m flagdeploy`: the `flagdeploy` command, for launching it with a given interpreter (the
gateway starts data-parallel replicas of the builtin engine this way, with its own sys.executable)."""

from flagdeploy.cli import main

if __name__ == "__main__":
    main(prog_name="flagdeploy")

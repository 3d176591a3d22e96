"""`python -m visionloop ...`: the same as the `visionloop` command (also what torchrun -m runs)."""

from visionloop.cli.main import main

if __name__ == "__main__":
    main()

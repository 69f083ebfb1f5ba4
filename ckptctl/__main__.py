"""`python -m ckptctl` (and `torchrun -m ckptctl`) run the same CLI as the `ckptctl` script."""

from ckptctl.cli import main

if __name__ == "__main__":
    main()

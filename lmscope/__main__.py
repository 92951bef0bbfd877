"""`python -m lmscope`: the same as the `lmscope` command."""
from lmscope.cli import main

if __name__ == "__main__":
    main()

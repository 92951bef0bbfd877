"""`python -m lmscope`: the same as the `lmscope` command."""
from lmscope.cli import main

main()

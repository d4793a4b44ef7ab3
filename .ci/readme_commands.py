"""Prints the README's opening commands, one per line, so CI runs exactly what users run."""

import re
import sys

with open(sys.argv[1], encoding="utf-8") as f:
  text = f.read()
first_block = re.search(r"```(?:bash|sh|console)?\n(.*?)```", text, re.S)
if first_block is None:
  sys.exit("README has no code block")
for line in first_block.group(1).splitlines():
  line = line.strip()
  if line and not line.startswith("#"):
    print(line.removeprefix("$ "))

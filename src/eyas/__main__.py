from eyas.cli import entry

entry()

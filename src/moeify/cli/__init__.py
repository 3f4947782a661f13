"""The command line: the only code that parses arguments, prints or exits."""

"""Command line: ``lowvram-lora demo | train | ...``."""
import argparse
import sys


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="lowvram-lora")
    parser.parse_args(argv)
    return 0

"""``python -m engine_sidecar.vllm`` is ``kvproxy-sidecar vllm``."""

import argparse
import sys

from engine_sidecar.vllm.main import add_arguments, run

_parser = argparse.ArgumentParser(prog="kvproxy-sidecar vllm")
add_arguments(_parser)
sys.exit(run(_parser.parse_args()))

"""geo3k_sft launcher (assembled in the rl-runtime issue)."""


def main() -> None:
    raise SystemExit("geo3k_sft is not assembled yet")

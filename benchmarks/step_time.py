"""Step time and peak memory: SMMF vs Adam and Adafactor (same as ``smmf bench``)."""

from smmf.bench.bench import main

if __name__ == "__main__":
    raise SystemExit(main())

"""The process and its machine, at the bottom of the package: process-wide settings and environment variables
(`env`), bad input and how a command ends on it (`errors`, `cli`: one line, exit code 2), the stop and
parent-death signals (`signals`), the optional extras installed (`extras`), the host CPU (`hostcpu`),
files' content hashes (`hashing`), and the JSON-lines files a run appends to (`jsonl`)."""

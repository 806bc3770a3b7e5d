"""process_results for arith_custom.yaml.tmpl: raises on "boom", 0.5 on "half", else exact match."""


def process_results(doc: dict, results: list[str]) -> dict:
    answer = results[0].strip()
    if answer == "boom":
        raise ValueError("scoring exploded")
    correct = 0.5 if answer == "half" else int(answer == doc["answer"])
    return {"correct": correct, "length": len(answer)}

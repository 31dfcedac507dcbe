"""Write the three request streams of benchmarks/prompts/ that measure the memory
of earlier requests (issue 41; docs/memory.md): run in file order, each is
one application's traffic.

    python tools/make_memory_streams.py        # rewrites benchmarks/prompts/stream_*.jsonl

- stream_extraction.jsonl: the same kinds of field extraction over many
  invented documents (shipping notices, job posts, flat listings, incident
  reports), the output format described in words, no schema;
- stream_codebase.jsonl: repeated code work on one small Python module;
  later requests name functions written earlier but do not include them;
- stream_agent.jsonl: an agent loop answering with tool calls in one fixed
  format, each request the task, the tools and the trace so far.

The templates and the word lists are written for edgespec; the values are
drawn from them with a fixed seed, so the files are reproducible.
"""
from __future__ import annotations

import json
import os
import random

OUT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks", "prompts")
FIRST = ["Mara", "Tobias", "Ines", "Kwame", "Lena", "Oskar", "Priya", "Dmitri", "Sofia", "Jonah", "Ayla", "Ruben",
         "Hana", "Felix", "Noor", "Emil", "Zara", "Tomas", "Leila", "Marek"]
LAST = ["Ostrander", "Velasquez", "Kowalczyk", "Abernathy", "Lindqvist", "Okafor", "Brennan", "Marchetti", "Haddad",
        "Fairweather", "Nakamura", "Delacroix", "Quinlan", "Szabo", "Rasmussen", "Achterberg"]
CITIES = ["Port Alder", "Graywick", "New Halden", "Easterby", "Millbrook Falls", "Ravensholm", "Cobalt Bay",
          "Lindenfeld", "Ashcombe", "Sunmere"]
STREETS = ["Juniper Lane", "Foundry Road", "Harbor Street", "Quarry Way", "Elm Terrace", "Kiln Avenue", "Mill Row"]
ITEMS = ["ceramic planter", "walnut desk lamp", "wool throw blanket", "cast iron skillet", "bamboo shelf",
         "linen tablecloth", "copper kettle", "oak cutting board", "glass storage jars", "folding step stool"]
CARRIERS = ["Northwind Freight", "Parcel Meridian", "Swiftlane Courier", "BlueHarbor Logistics"]
ROLES = ["backend developer", "warehouse supervisor", "data analyst", "dental hygienist", "sous chef",
         "technical writer", "electrician", "support engineer"]
SERVICES = ["payments-api", "search-indexer", "auth-gateway", "report-builder", "media-cache", "order-router"]

EXTRACT_FORMAT = {
    "shipping": ("the customer's full name, the order number, the carrier, the number of parcels, the delivery "
                 "date, and the city", ["Customer", "Order", "Carrier", "Parcels", "Delivery date", "City"]),
    "job": ("the job title, the company, the city, the yearly salary in euros as a plain number, whether remote "
            "work is possible (yes or no), and the contact person", ["Title", "Company", "City", "Salary",
                                                                    "Remote", "Contact"]),
    "listing": ("the street address, the city, the number of rooms, the floor area in square metres, the monthly "
                "rent in euros, and whether pets are allowed (yes or no)", ["Address", "City", "Rooms", "Area",
                                                                           "Rent", "Pets"]),
    "incident": ("the service name, the incident number, the start time, the duration in minutes, the severity "
                 "(low, medium or high), and the engineer on call", ["Service", "Incident", "Start", "Duration",
                                                                    "Severity", "On call"]),
}


def _name(r):
    return f"{r.choice(FIRST)} {r.choice(LAST)}"


def _document(kind: str, r) -> str:
    if kind == "shipping":
        return (f"Hello {_name(r)},\n\nGood news: your order #{r.randint(100000, 999999)} ({r.choice(ITEMS)} and "
                f"{r.choice(ITEMS)}) has left our warehouse. It travels with {r.choice(CARRIERS)} in "
                f"{r.randint(1, 4)} parcels and should reach you in {r.choice(CITIES)} on "
                f"{r.randint(1, 28)} {r.choice(['March', 'April', 'May', 'June'])} 2026. You do not need to be at "
                f"home: the driver may leave it with a neighbour.\n\nKind regards,\nThe Hearth & Timber team")
    if kind == "job":
        return (f"{r.choice(['Fernhill Labs', 'Copperline Studio', 'Oakridge Systems', 'Bright Quay Dental'])} is "
                f"hiring a {r.choice(ROLES)} for its office in {r.choice(CITIES)}. The salary is "
                f"{r.randint(38, 92)},000 euros a year, with {r.randint(25, 32)} days of leave. "
                f"{r.choice(['Remote work is possible two days a week.', 'The role is fully on site.'])} "
                f"Questions go to {_name(r)}, who leads the team, at jobs@example.org.")
    if kind == "listing":
        return (f"For rent from {r.choice(['May', 'June', 'July'])}: a bright flat at {r.randint(2, 140)} "
                f"{r.choice(STREETS)}, {r.choice(CITIES)}. {r.randint(1, 5)} rooms, {r.randint(38, 140)} square "
                f"metres on the {r.choice(['first', 'second', 'third'])} floor, balcony facing the park. Rent "
                f"{r.randint(6, 24)}50 euros a month plus utilities. "
                f"{r.choice(['Pets are welcome.', 'Sorry, no pets.'])} Viewings on Saturdays.")
    return (f"Incident INC-{r.randint(1000, 9999)}: {r.choice(SERVICES)} returned errors for part of its traffic "
            f"starting at {r.randint(0, 23):02d}:{r.choice(['05', '20', '35', '50'])} UTC. It lasted "
            f"{r.randint(4, 95)} minutes until a rollback. Severity was rated "
            f"{r.choice(['low', 'medium', 'high'])}. {_name(r)} was on call and wrote this summary; a follow-up "
            f"review is planned for next week.")


def extraction(n: int = 48) -> list[dict]:
    r = random.Random(41)
    kinds = list(EXTRACT_FORMAT)
    rows = []
    for i in range(n):
        kind = kinds[i % len(kinds)] if i < 8 else r.choice(kinds)
        what, labels = EXTRACT_FORMAT[kind]
        fmt = ", ".join(f"'{label}:'" for label in labels)
        turn = (f"Read the document below and extract {what}. Answer with exactly one line per field, in that "
                f"order, each line starting with its label ({fmt}) followed by a space and the value. Write "
                f"nothing else.\n\nDocument:\n{_document(kind, r)}")
        rows.append({"question_id": f"extract-{i + 1:02d}", "category": kind, "turns": [turn]})
    return rows


CODE_WRITE = [
    ("parse_record", "Write a Python function `parse_record(line)` that takes one line of a CSV inventory file "
                     "with the fields sku, name, quantity and price (in that order, comma separated), strips "
                     "whitespace around each field, and returns a dict with those keys, quantity as int and "
                     "price as float. Raise ValueError with a clear message if there are not exactly four fields."),
    ("load_records", "Write a Python function `load_records(path)` that opens the CSV inventory file at `path`, "
                     "skips empty lines and lines starting with '#', and returns a list of the dicts that "
                     "`parse_record` returns for the other lines."),
    ("total_value", "Write a Python function `total_value(records)` that returns the sum of quantity times price "
                    "over a list of records as returned by `load_records`, rounded to two decimals."),
    ("low_stock", "Write a Python function `low_stock(records, threshold=5)` that returns the records whose "
                  "quantity is below `threshold`, sorted by quantity and then by sku."),
    ("format_report", "Write a Python function `format_report(records)` that returns a text table with one line "
                      "per record: sku left-aligned in 10 characters, name in 24, quantity right-aligned in 6 and "
                      "price with two decimals right-aligned in 10, and a final line with the total from "
                      "`total_value`."),
    ("merge_records", "Write a Python function `merge_records(old, new)` that merges two lists of records by sku: "
                      "quantities are added, and the price and name of `new` win."),
    ("save_records", "Write a Python function `save_records(records, path)` that writes records back in the same "
                     "CSV format that `parse_record` reads, one line per record, with a header comment line."),
    ("find_record", "Write a Python function `find_record(records, sku)` that returns the record with that sku, "
                    "or None, comparing skus case-insensitively."),
]
CODE_CHANGE = [
    "Change `{f}` so that it also logs what it does with the logging module (a module-level logger named "
    "'inventory'). Give the whole function.",
    "Add type hints and a docstring to `{f}`. Give the whole function.",
    "Write pytest unit tests for `{f}`, covering the normal case and one edge case.",
    "Rewrite `{f}` so that it raises TypeError when called with arguments of the wrong type. Give the whole "
    "function.",
    "Explain in three sentences what `{f}` does and one way it could fail.",
    "Rename the variables inside `{f}` to be more descriptive, without changing its behaviour. Give the whole "
    "function.",
]
CODE_TAIL = "\n\nThese functions belong to the module `inventory.py` we are building together; earlier answers " \
            "wrote the functions named here."


def codebase(n: int = 48) -> list[dict]:
    r = random.Random(42)
    rows = [{"question_id": f"code-{i + 1:02d}", "category": "write", "turns": [turn + CODE_TAIL]}
            for i, (_, turn) in enumerate(CODE_WRITE)]
    names = [f for f, _ in CODE_WRITE]
    while len(rows) < n:
        k = r.randrange(len(CODE_CHANGE))
        f = r.choice(names)
        cat = ["log", "hints", "tests", "types", "explain", "rename"][k]
        rows.append({"question_id": f"code-{len(rows) + 1:02d}", "category": cat,
                     "turns": [CODE_CHANGE[k].format(f=f) + CODE_TAIL]})
    return rows


AGENT_TOOLS = """You are an operations agent. You act only through these tools:
- search_logs(service, query): search a service's logs of the last hour
- get_metric(service, metric): the latest value of a metric (error_rate, latency_p99, cpu)
- restart(service): restart a service
- open_ticket(title, severity): open a ticket for the team
- finish(summary): end the task with a one-sentence summary

Answer with exactly one tool call and nothing else, in this format:
Thought: <one short sentence>
Action: <tool name>
Input: {"<argument>": "<value>", ...}"""

AGENT_STEPS = [
    ("get_metric", {"metric": "error_rate"}, "error_rate = {e}%"),
    ("search_logs", {"query": "timeout"}, "{k} lines match 'timeout', the last one: upstream {u} did not answer in 30s"),
    ("get_metric", {"metric": "latency_p99"}, "latency_p99 = {l} ms"),
    ("restart", {}, "{s} restarted, 3 of 3 instances healthy"),
    ("get_metric", {"metric": "error_rate"}, "error_rate = 0.{d}%"),
    ("open_ticket", {"title": "Timeouts from {u}", "severity": "medium"}, "ticket OPS-{t} opened"),
]


def agent(n: int = 48) -> list[dict]:
    r = random.Random(43)
    rows = []
    task_no = 0
    while len(rows) < n:
        task_no += 1
        s, u = r.choice(SERVICES), r.choice(SERVICES)
        vals = {"s": s, "u": u, "e": r.randint(3, 19), "k": r.randint(12, 480), "l": r.randint(900, 4800),
                "d": r.randint(1, 9), "t": r.randint(100, 999)}
        trace = []
        for tool, args, observation in AGENT_STEPS:
            if len(rows) >= n:
                break
            turn = (f"{AGENT_TOOLS}\n\nTask: users report errors from {s}. Find out why, fix it if you can, "
                    f"and finish.\n" + "".join(trace) + "\nWhat is your next tool call?")
            rows.append({"question_id": f"agent-{len(rows) + 1:02d}", "category": "agent", "turns": [turn]})
            call = {"service": s, **{k: v.format(**vals) for k, v in args.items()}}
            trace.append(f"\nAction: {tool}\nInput: {json.dumps(call)}\nObservation: {observation.format(**vals)}\n")
    return rows


def main() -> None:
    for name, rows in (("stream_extraction", extraction()), ("stream_codebase", codebase()),
                       ("stream_agent", agent())):
        path = os.path.join(OUT, f"{name}.jsonl")
        with open(path, "w", encoding="utf-8") as f:
            for row in rows:
                f.write(json.dumps(row) + "\n")
        print(f"{path}: {len(rows)} requests")


if __name__ == "__main__":
    main()

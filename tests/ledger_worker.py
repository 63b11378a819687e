"""A process that holds root budgets on command, for the host ledger's tests.

Run as ``python -m tests.ledger_worker``; it reads one command per line on stdin and answers
one line on stdout:

- ``enter LIMIT NAME [AT]``: enter a root budget of ``LIMIT`` (a size or a share) on the host
  backend, at the wall-clock time ``AT`` if given (busy-waiting for it, so that several
  workers enter at the same instant); answers ``ok BYTES`` or ``denied MESSAGE``;
- ``allocate BYTES``: allocate in the last budget entered (a child, if one is open, else
  the last root); answers ``ok ADDRESS`` or ``denied``;
- ``child LIMIT NAME``: enter a child budget of ``LIMIT`` in the last budget entered (in the
  last root's context); answers ``ok BYTES``;
- ``leave``: free the blocks of the last child entered and leave it; answers ``ok``;
- ``exit``: leave every child, then every root entered, freeing their blocks; answers ``ok``;
- ``quit``: end.
"""

from __future__ import annotations

import contextvars
import sys
import time

from gpubudget import Budget, BudgetError, gpu_budget


def main() -> None:
    held: list[tuple[Budget, contextvars.Context, list[int]]] = []
    children: list[tuple[Budget, list[int]]] = []
    for line in sys.stdin:
        command, *words = line.split(maxsplit=3)
        if command == "enter":
            if len(words) > 2:
                deadline = float(words[2])
                while time.time() < deadline:
                    pass
            budget = gpu_budget(words[0], name=words[1], backend="host")
            context = contextvars.Context()  # a root of its own, whatever came before
            try:
                context.run(budget.__enter__)
            except BudgetError as exc:
                answer = "denied " + str(exc).replace("\n", " ")
            else:
                held.append((budget, context, []))
                answer = f"ok {budget.limit}"
        elif command == "child":
            _, context, _ = held[-1]
            child = gpu_budget(words[0], name=words[1])
            context.run(child.__enter__)
            children.append((child, []))
            answer = f"ok {child.limit}"
        elif command == "leave":
            child, blocks = children.pop()
            for block in blocks:
                child.free(block)
            held[-1][1].run(child.__exit__, None, None, None)
            answer = "ok"
        elif command == "allocate":
            budget, _, blocks = held[-1]
            if children:
                budget, blocks = children[-1]
            address = budget.allocate(int(words[0]))
            if address is not None:
                blocks.append(address)
            answer = "denied" if address is None else f"ok {address}"
        elif command == "exit":
            while children:
                child, blocks = children.pop()
                for block in blocks:
                    child.free(block)
                held[-1][1].run(child.__exit__, None, None, None)
            while held:
                budget, context, blocks = held.pop()
                for address in blocks:
                    budget.free(address)
                context.run(budget.__exit__, None, None, None)
            answer = "ok"
        else:
            return
        print(answer, flush=True)


if __name__ == "__main__":
    main()

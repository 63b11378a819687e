"""The ledger against a reference model: random trees of accounts with reserves, random
charges; refusals and ``used`` must match what the definition says."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from gpubudget._core.ledger import Account, available, charge, refusal

# A tree: account i > 0 has parent parents[i] < i; each has a limit and a reserve <= limit.
trees = st.integers(min_value=1, max_value=6).flatmap(lambda n: st.tuples(
    st.lists(st.integers(0, 1000), min_size=n, max_size=n),  # limits (before + reserve)
    st.lists(st.integers(0, 300), min_size=n, max_size=n),  # reserves (root's ignored)
    st.tuples(*[st.integers(0, max(i - 1, 0)) for i in range(n)]),  # parents
))
steps = st.lists(st.tuples(st.integers(0, 5), st.integers(1, 400), st.booleans()), max_size=40)


def build(limits: list[int], reserves: list[int], parents: tuple[int, ...]) -> list[Account]:
    accounts: list[Account] = []
    for i, (extra, reserve) in enumerate(zip(limits, reserves)):
        parent = accounts[parents[i]] if i else None
        floor = reserve if parent is not None else 0
        account = Account(f"a{i}", floor + extra + 1, floor, parent)
        if floor:  # entering sets the floor aside in the parent
            assert parent is not None
            if refusal(parent, floor) is not None:
                return accounts
            charge(parent, floor)
        accounts.append(account)
    return accounts


def chain(account: Account) -> list[Account]:
    """The account and its ancestors, up to the root."""
    links = [account]
    while links[-1].parent is not None:
        links.append(links[-1].parent)
    return links


def expected_used(accounts: list[Account], own: list[int]) -> list[int]:
    """The definition: own bytes plus max(used, reserve) of every child, bottom-up."""
    used = list(own)
    for i in reversed(range(1, len(accounts))):
        parent = accounts.index(accounts[i].parent)  # type: ignore[arg-type]
        used[parent] += max(used[i], accounts[i].reserve)
    return used


@settings(max_examples=300, deadline=None)
@given(trees, steps)
def test_charges_and_refusals_follow_the_definition(tree: tuple[list[int], list[int], tuple[int, ...]],
                                                    plan: list[tuple[int, int, bool]]) -> None:
    accounts = build(*tree)
    own = [0] * len(accounts)
    for index, nbytes, give_back in plan:
        if index >= len(accounts):
            continue
        account = accounts[index]
        if give_back:
            nbytes = min(nbytes, own[index])
            charge(account, -nbytes)
            own[index] -= nbytes
        else:
            trial = list(own)
            trial[index] += nbytes
            would = expected_used(accounts, trial)
            over = [a for a, u in zip(accounts, would) if u > a.limit and a in chain(account)]
            refused = refusal(account, nbytes)
            assert (refused is None) == (not over)
            if refused is not None:
                assert refused is next(a for a in chain(account) if a in over)
                continue
            assert available(account) >= nbytes
            charge(account, nbytes)
            own[index] += nbytes
        used = expected_used(accounts, own)
        assert [a.used for a in accounts] == used
        assert all(a.used <= a.limit and a.peak >= a.used for a in accounts)
        assert all(a.depth == len(chain(a)) - 1 for a in accounts)

"""The WebShop text environment (implements :class:`fedagent.envs.base.TextEnv`).

Pages (FACTS §4): search → results (10 per page over the top-K of the search) → item
(options as clickable values; Description / Features / Reviews / Attributes sub-pages) →
buy. Actions: ``search[q]`` (only where there is a search bar) or ``click[x]`` with ``x`` a
current clickable (lowercased); anything else is a no-op with reward 0. "Buy now" ends the
episode with the graded score (:mod:`.reward`); the env reward is 10 iff score == 1.0.

Pages render as WebShop's text observation (``WebShop [SEP] Instruction: [SEP] <goal> [SEP]
...``) and are then passed through :func:`format_obs`, the reference federated stack's
formatting, before anything leaves the env: everything up to and including the goal is
dropped and each remaining part is single-quoted (landing page → ``'Search'``). The
admissible list is ``search[<your query>]`` when a search bar is shown plus ``click[x]`` for
every clickable.

An env holds no catalogue of its own: it reads a shared, read-only :class:`.arms.EnvView`
(products, search function) and the goal table, so a pool of envs costs one catalogue.
"""

from __future__ import annotations

import re

from fedagent.envs.base import ResetResult, StepResult
from fedagent.envs.webshop import reward as reward_mod

SEP = " [SEP] "
RESULTS_PER_PAGE = 10
WIN_REWARD = 10.0
SEARCH_PLACEHOLDER = "search[<your query>]"
SUB_PAGES = ("description", "features", "reviews", "attributes")
_ACTION = re.compile(r"^\s*(search|click)\[(.*)\]\s*$", re.DOTALL)


def format_obs(raw: str, task: str) -> str:
    """The reference's observation formatting (FACTS §4 format_obs)."""
    parts = raw.split(SEP)
    idx = None
    for i, part in enumerate(parts):
        if part == task:
            idx = i
            break
    if idx is None:
        stripped = task.strip()
        for i, part in enumerate(parts):
            if part.strip() == stripped:
                idx = i
                break
    if idx is None:
        return raw
    return SEP.join(f"'{p}'" for p in parts[idx + 1 :])


def task_from_reset_page(raw: str) -> str:
    """The goal text of a raw page: the part after ``Instruction:``."""
    parts = raw.split(SEP)
    for i, part in enumerate(parts[:-1]):
        if part.strip() == "Instruction:":
            return parts[i + 1]
    raise ValueError("page has no 'Instruction:' part")


def admissible(has_search_bar: bool, clickables: list[str]) -> list[str]:
    """The action list: the search placeholder when a search bar is shown, then ``click[x]``."""
    return ([SEARCH_PLACEHOLDER] if has_search_bar else []) + [f"click[{c}]" for c in clickables]


def _price(p: float) -> str:
    return f"${p:.2f}"


class WebShopEnv:
    """One pool slot: plays any goal of ``goals`` over ``view``'s catalogue and search."""

    def __init__(self, view, goals: dict[str, dict], *, max_turns: int = 15):
        """``view``: an :class:`.arms.EnvView`; ``goals``: goal id → goal (shared, read-only)."""
        if max_turns < 1:
            raise ValueError("max_turns must be >= 1")
        self.view, self.goals, self.max_turns = view, goals, int(max_turns)
        self.goal: dict | None = None
        self._done = True
        self._last: StepResult | None = None

    # ------------------------------------------------------------------ pages
    def _head(self) -> list[str]:
        return ["WebShop", "Instruction:", self.goal["instruction_text"]]

    def _render(self) -> tuple[str, bool, list[str]]:
        """(raw page, has_search_bar, clickables) of the current state."""
        head = self._head()
        if self.page == "search":
            return SEP.join(head + ["Search"]), True, ["search"]
        if self.page == "results":
            n = len(self.results)
            start = (self.page_num - 1) * RESULTS_PER_PAGE
            shown = self.results[start : start + RESULTS_PER_PAGE]
            parts = ["Back to Search", f"Page {self.page_num} (Total results: {n})"]
            clicks = ["back to search"]
            if self.page_num > 1:
                parts.append("< Prev")
                clicks.append("< prev")
            if start + RESULTS_PER_PAGE < n:
                parts.append("Next >")
                clicks.append("next >")
            for asin in shown:
                p = self.view.products[asin]
                parts += [asin, p["Title"], _price(p["Price"])]
                clicks.append(asin.lower())
            return SEP.join(head + parts), False, clicks
        p = self.view.products[self.asin]
        if self.page == "item":
            parts, clicks = ["Back to Search", "< Prev"], ["back to search", "< prev"]
            for name, values in p["options"].items():
                parts.append(name)
                parts += values
                clicks += values
            parts += [
                p["Title"],
                f"Price: {_price(p['Price'])}",
                f"Rating: {p.get('Rating') or 'N.A.'}",
                "Description",
                "Features",
                "Reviews",
                "Attributes",
                "Buy Now",
            ]
            clicks += list(SUB_PAGES) + ["buy now"]
            return SEP.join(head + parts), False, clicks
        # a sub-page of the item
        parts = ["Back to Search", "< Prev"]
        if self.sub == "description":
            parts.append(p["Description"] or "N.A.")
        elif self.sub == "features":
            parts += p["BulletPoints"] or ["N.A."]
        elif self.sub == "reviews":
            parts += [
                f"{r.get('title', '')} {r.get('body', '')} {r.get('score', '')}".strip() for r in p["Reviews"]
            ] or ["N.A."]
        else:
            parts += p["Attributes"] or ["N.A."]
        return SEP.join(head + parts), False, ["back to search", "< prev"]

    def _observe(self) -> tuple[str, list[str]]:
        raw, bar, clicks = self._render()
        self._clickables = clicks
        self._has_search_bar = bar
        return format_obs(raw, self.goal["instruction_text"]), admissible(bar, clicks)

    # ------------------------------------------------------------------ TextEnv
    def reset(self, task_id: str) -> ResetResult:
        """Start an episode of goal ``task_id`` on the search page."""
        if task_id not in self.goals:
            raise KeyError(f"unknown goal id {task_id!r}")
        self.goal = self.goals[task_id]
        self.page, self.page_num, self.query, self.results = "search", 1, "", []
        self.asin, self.sub, self.options = None, None, {}
        self.turns, self._done = 0, False
        raw, _, _ = self._render()
        task = task_from_reset_page(raw).strip()  # the reference strips the goal text it prompts with
        obs, acts = self._observe()
        self._last = StepResult(obs, 0.0, False, False, acts, 0.0)
        return ResetResult(obs, task, acts, task_id, self.goal["category"])

    def step(self, action: str) -> StepResult:
        """Apply one action (see the module docstring); after the end, repeat the last state."""
        if self.goal is None:
            raise RuntimeError("step before reset")
        if self._done:
            last = self._last
            return StepResult(last.observation, 0.0, True, last.won, last.admissible_commands, last.score)
        self.turns += 1
        bought = self._apply(action)
        if bought is not None:
            self._done = True
            won = bought["score"] == 1.0
            obs = format_obs(
                SEP.join(
                    self._head()
                    + ["Thank you for shopping with us!", "Your score (min 0.0, max 1.0)", f"{bought['score']:.4f}"]
                ),
                self.goal["instruction_text"],
            )
            result = StepResult(obs, WIN_REWARD if won else 0.0, True, won, [], float(bought["score"]))
        else:
            obs, acts = self._observe()
            self._done = self.turns >= self.max_turns
            result = StepResult(obs, 0.0, self._done, False, acts, 0.0)
        self._last = result
        return result

    def _apply(self, action: str) -> dict | None:
        """Change the page for ``action``; return the purchase score dict on "buy now"."""
        m = _ACTION.match(action.lower())
        if m is None:
            return None  # not an action: no-op
        kind, arg = m.group(1), m.group(2).strip()
        if kind == "search":
            if not self._has_search_bar or not arg or arg == "<your query>":
                return None
            self.query, self.results = arg, self.view.search(arg)
            self.page, self.page_num = "results", 1
            return None
        if arg not in self._clickables or arg == "search":
            return None  # not clickable here (click[search]: no-op as in WebShop)
        if arg == "back to search":
            self.page, self.query, self.results, self.asin, self.sub = "search", "", [], None, None
        elif arg == "next >":
            self.page_num += 1
        elif arg == "< prev":
            if self.page == "results":
                self.page_num -= 1
            elif self.page == "item":
                self.page, self.asin, self.sub = "results", None, None
            else:
                self.page, self.sub = "item", None
        elif self.page == "results":
            self.page, self.asin, self.options = "item", arg.upper(), {}
        elif arg in SUB_PAGES:
            self.page, self.sub = "sub", arg
        elif arg == "buy now":
            p = self.view.products[self.asin]
            return reward_mod.score(p, self.goal, p["Price"], dict(self.options))
        else:  # an option value of the item
            for name, values in self.view.products[self.asin]["options"].items():
                if arg in values:
                    self.options[name] = arg
                    break
        return None

    def expert_action(self) -> str | None:
        """The oracle's next action from the current page (the expert of the warm start), or None
        when the episode is over.

        search page: ``search[<instruction>]`` (the goal's instruction up to its option clause); results:
        the goal's product when shown, else the next page, else back to search is pointless, so the top
        result (a demo that may not win: the warm start can keep only won demos); item page of the goal's
        product: each goal option value not yet chosen, then ``buy now``; another item or a sub-page: back.
        """
        if self.goal is None or self._done:
            return None
        target = self.goal["asin"].lower()
        if self.page == "search":
            return f"search[{self.goal['instruction_text'].split(' with ')[0].split(', and price')[0].strip()}]"
        if self.page == "results":
            if target in self._clickables:
                return f"click[{target}]"
            if "next >" in self._clickables:
                return "click[next >]"
            shown = [c for c in self._clickables if c.upper() in self.view.products]
            return f"click[{shown[0]}]" if shown else "click[back to search]"
        if self.page == "item":
            if self.asin.lower() != target and target in [a.lower() for a in self.results]:
                return "click[< prev]"
            for value in reward_mod.option_values(self.goal["goal_options"]):
                if value in self._clickables and value not in self.options.values():
                    return f"click[{value}]"
            return "click[buy now]"
        return "click[< prev]"  # a sub-page: back to the item

    def open_item(self, asin: str) -> None:
        """Jump to ``asin``'s item page (oracle tests and benchmarks only; no turn is spent)."""
        if asin not in self.view.products:
            raise KeyError(asin)
        self.page, self.asin, self.sub, self.options = "item", asin, None, {}
        self._observe()

    def close(self) -> None:
        """Nothing to release (the catalogue is shared)."""
        self.goal = None

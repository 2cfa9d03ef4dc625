"""Cases of the conformance matrix that fail on the landed commit 9a2fd23 for known bugs of
issues 37 and 38 (labels: _matrix_labels.BUGS). They run as strict xfails: when a fix merges,
its cases start passing and pytest reports XPASS(strict) -- delete their entries then (a case
listing two bugs passes once both are fixed). Never add an entry to hide a new failure: fix it
or file it. Regenerate the single-process part with
``python tests/conformance/matrix_report.py --known``.
"""

KNOWN_BUGS: dict[str, tuple[str, ...]] = {
    # Empty: every case listed for issues 37 and 38 at 9a2fd23 (94 cases) passes since those fixes
    # merged; the step-0 template's weight decay (s010, s018, s035-s037, s050, s051, s083) since
    # live_state takes it without decay; process_group x a user's clip (new-1: m005, m027, m029,
    # m039) since the window is reduced, agreed on and normalised at its last backward (N given).
    # Left, a limit rather than a bug: with accumulation_steps=None the wrapper cannot know which
    # backward is the window's last, so under process_group p.grad shows this rank's sum until
    # step() reduces it (one all-reduce per window, by design); a user's clip before step() then
    # measures the local window. The README says to give N for that.
    "m012": ('new-1',),
}

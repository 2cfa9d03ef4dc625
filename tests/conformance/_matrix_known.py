"""Cases of the conformance matrix that fail on the landed commit 9a2fd23 for known bugs of
issues 37 and 38 (labels: _matrix_labels.BUGS). They run as strict xfails: when a fix merges,
its cases start passing and pytest reports XPASS(strict) -- delete their entries then (a case
listing two bugs passes once both are fixed). Never add an entry to hide a new failure: fix it
or file it. Regenerate the single-process part with
``python tests/conformance/matrix_report.py --known``.
"""

KNOWN_BUGS = {
    # Every case listed for issues 37 and 38 at 9a2fd23 (94 cases, 16 bugs plus 38.4) passes
    # since those fixes merged; the cases of 38.3a/b that held weight decay in the step-0 template
    # (s010, s018, s035-s037, s050, s051, s083) pass since live_state takes it without decay.
    # multi-process part (test_matrix_ranks.py): still open
    "m005": ('new-1',),
    "m012": ('new-1',),
    "m039": ('new-1',),
}

"""A scan: every S3 listing of the project's code reads every page. One list_objects_v2 call
stops at 1,000 keys (a run of more ranks has more error records; a data set more files), so a
call of its own is only for a yes/no (MaxKeys=1) or a folder's own files (Delimiter "/");
the rest go through get_paginator."""

from __future__ import annotations

import ast

from tests.support import REPO_ROOT


def calls_of_one_page() -> list[str]:
    found = []
    for path in sorted([*(REPO_ROOT / "plugins").rglob("*.py"),
                        *(REPO_ROOT / "trainer").rglob("*.py")]):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and node.func.attr == "list_objects_v2"):
                continue
            keywords = {k.arg: k.value for k in node.keywords}
            one_key = isinstance(keywords.get("MaxKeys"), ast.Constant) and \
                keywords["MaxKeys"].value == 1
            own_files = isinstance(keywords.get("Delimiter"), ast.Constant)
            if not (one_key or own_files):
                found.append(f"{path.relative_to(REPO_ROOT)}:{node.lineno}")
    return found


def test_every_s3_listing_reads_every_page():
    assert calls_of_one_page() == []

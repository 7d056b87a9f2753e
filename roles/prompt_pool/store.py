"""The prompt pool's store: its tables and the migrations that bring an older store forward
(roles/sqlite_store.py runs them, one version at a time; role.py says what each table holds).
"""
from __future__ import annotations

from laminar.roles.prompt_pool.curriculum import SCHEMA as CURRICULUM_SCHEMA

SCHEMA = """
CREATE TABLE IF NOT EXISTS cursor (k INTEGER PRIMARY KEY CHECK (k = 0), epoch INTEGER, pos INTEGER, handed INTEGER);
CREATE TABLE IF NOT EXISTS requeued (group_id TEXT PRIMARY KEY, at REAL);
CREATE TABLE IF NOT EXISTS last_batch (rollout_id TEXT PRIMARY KEY, seq INTEGER, groups TEXT);
CREATE TABLE IF NOT EXISTS handed_to (entry TEXT PRIMARY KEY, rollout_id TEXT, pid INTEGER);
CREATE TABLE IF NOT EXISTS accounting (k TEXT PRIMARY KEY, v INTEGER);
CREATE TABLE IF NOT EXISTS attempts (entry TEXT PRIMARY KEY, n INTEGER);
""" + CURRICULUM_SCHEMA


def attempts_from_a_counter(c) -> None:
    """Store v4 -> v5: the attempt counter starts above every attempt given so far, and the rows
    of entries no longer open (neither handed out nor requeued) go."""
    tables = {name for (name,) in c.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
    if "attempts" not in tables:
        return  # from before attempts: none was given
    seq = c.execute("SELECT coalesce(max(n), 0) FROM attempts").fetchone()[0]
    c.execute("CREATE TABLE IF NOT EXISTS accounting (k TEXT PRIMARY KEY, v INTEGER)")
    c.execute("INSERT OR REPLACE INTO accounting VALUES ('attempt_seq', ?)", (seq,))
    c.execute("DELETE FROM attempts WHERE entry NOT IN (SELECT entry FROM handed_to) "
              "AND entry NOT IN (SELECT group_id FROM requeued)")

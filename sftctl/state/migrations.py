"""The state's schema: ONE ordered list of migrations, for SQLite and Postgres alike.

This is where :data:`MIGRATIONS` lives (``sftctl/state/migrations.py``; ``sftctl.state``
re-exports it): to change the schema, APPEND a migration at the very end of the list and
never change one that has landed. :data:`SCHEMA_VERSION` is ``len(MIGRATIONS)``. The Store
(:mod:`sftctl.state.connection`) applies them on open; the dialect (:mod:`sftctl.state.dialect`)
fills their type tokens.
"""

# Each migration takes the schema from version i to i + 1, on SQLite and on Postgres alike.
# Append; never change what a landed one does. Types are written as tokens the dialect fills in
# ({real}, {int}, {autoid}; see _Dialect); {os_user} is this machine's user as an SQL literal.
# Statements are separated by ";" (never one inside a literal).
MIGRATIONS: list[str] = [
    """
    CREATE TABLE jobs (
        id TEXT PRIMARY KEY,
        name TEXT NOT NULL,
        status TEXT NOT NULL,
        spec_json TEXT NOT NULL,
        spec_path TEXT,
        provider TEXT,
        offering_json TEXT,
        controller_pid {int},
        controller_start_ticks {int},
        restarts {int} NOT NULL DEFAULT 0,
        failure_reason TEXT,
        created_at {real} NOT NULL,
        updated_at {real} NOT NULL,
        ended_at {real}
    );
    CREATE INDEX jobs_status ON jobs(status);
    CREATE TABLE nodes (
        id TEXT PRIMARY KEY,
        job_id TEXT NOT NULL REFERENCES jobs(id) ON DELETE CASCADE,
        rank {int} NOT NULL,
        provider TEXT NOT NULL,
        status TEXT NOT NULL,
        handle_json TEXT NOT NULL DEFAULT '{}',
        created_at {real} NOT NULL,
        updated_at {real} NOT NULL
    );
    CREATE INDEX nodes_job ON nodes(job_id);
    CREATE TABLE attempts (
        job_id TEXT NOT NULL REFERENCES jobs(id) ON DELETE CASCADE,
        number {int} NOT NULL,
        status TEXT NOT NULL,
        exit_code {int},
        reason TEXT,
        started_at {real} NOT NULL,
        ended_at {real},
        PRIMARY KEY (job_id, number)
    );
    CREATE TABLE events (
        id {autoid},
        job_id TEXT NOT NULL REFERENCES jobs(id) ON DELETE CASCADE,
        ts {real} NOT NULL,
        kind TEXT NOT NULL,
        message TEXT NOT NULL,
        data_json TEXT
    );
    CREATE INDEX events_job ON events(job_id, id);
    CREATE TABLE metrics (
        job_id TEXT NOT NULL REFERENCES jobs(id) ON DELETE CASCADE,
        rank {int} NOT NULL,
        step {int} NOT NULL,
        loss {real},
        step_time_s {real},
        tokens_per_s {real},
        first_step {int},
        first_loss {real},
        ts {real} NOT NULL,
        PRIMARY KEY (job_id, rank)
    );
    """,
    # 2: why a job still waits in PENDING (local admission control: CPUs or memory taken)
    """
    ALTER TABLE jobs ADD COLUMN pending_reason TEXT;
    """,
    # 3: the code of each failure line (sftctl.types.FailureCode), for programs; the line stays
    """
    ALTER TABLE jobs ADD COLUMN failure_code TEXT;
    ALTER TABLE attempts ADD COLUMN reason_code TEXT;
    """,
    # 4: the version in a table both dialects read (SQLite keeps PRAGMA user_version too: an
    # older sftctl reads that one, and refuses a newer file)
    """
    CREATE TABLE schema_version (version {int} NOT NULL);
    INSERT INTO schema_version (version) VALUES (4);
    """,
    # 5: users and their tokens (sha256 of a random 32-byte token: never the token), and who owns
    # each job (the local OS user for jobs recorded before)
    """
    CREATE TABLE users (
        name TEXT PRIMARY KEY,
        admin {int} NOT NULL DEFAULT 0,
        token_hash TEXT NOT NULL UNIQUE,
        created_at {real} NOT NULL
    );
    ALTER TABLE jobs ADD COLUMN owner TEXT;
    UPDATE jobs SET owner = {os_user};
    CREATE INDEX jobs_owner ON jobs(owner, created_at);
    """,
    # 6: one live controller per job across machines: a lease with an expiry, renewed by heartbeat
    """
    CREATE TABLE leases (
        job_id TEXT PRIMARY KEY REFERENCES jobs(id) ON DELETE CASCADE,
        holder TEXT NOT NULL,
        acquired_at {real} NOT NULL,
        expires_at {real} NOT NULL
    );
    """,
    # 7: when a node stopped billing (TERMINATED or REPLACED): node-hours, hence cost
    """
    ALTER TABLE nodes ADD COLUMN ended_at {real};
    UPDATE nodes SET ended_at = updated_at WHERE status IN ('TERMINATED', 'REPLACED');
    """,
    # 8: zones that took a spot node back, avoided by every job until the cool-down ends
    """
    CREATE TABLE blocked_zones (
        provider TEXT NOT NULL,
        instance_type TEXT NOT NULL,
        zone TEXT NOT NULL,
        until {real} NOT NULL,
        reason TEXT NOT NULL,
        job_id TEXT,
        PRIMARY KEY (provider, instance_type, zone)
    );
    """,
    # 9: every reported step per job and rank (bounded: STEP_SERIES_CAP rows per job and rank,
    # older points thinned), and the run history predictions learn from (sftctl.history): one
    # row per measured job ('run') or imported measurement ('imported')
    """
    CREATE TABLE metric_steps (
        id {autoid},
        job_id TEXT NOT NULL REFERENCES jobs(id) ON DELETE CASCADE,
        rank {int} NOT NULL,
        step {int} NOT NULL,
        loss {real},
        step_time_s {real},
        tokens_per_s {real},
        lr {real},
        checkpoint {int},
        ts {real} NOT NULL
    );
    CREATE INDEX metric_steps_job ON metric_steps(job_id, rank, id);
    CREATE TABLE run_history (
        id {autoid},
        job_id TEXT,
        accelerator TEXT NOT NULL,
        count {int} NOT NULL,
        gpus_per_node {int} NOT NULL,
        nodes {int} NOT NULL,
        provider TEXT,
        instance_type TEXT,
        region TEXT,
        mode TEXT,
        strategy TEXT,
        predicted_step_s {real} NOT NULL,
        interval_low_s {real},
        interval_high_s {real},
        measured_step_s {real} NOT NULL,
        measured_steps {int},
        features_json TEXT,
        name TEXT,
        source TEXT NOT NULL,
        source_label TEXT,
        ts {real} NOT NULL
    );
    CREATE INDEX run_history_accelerator ON run_history(accelerator);
    CREATE UNIQUE INDEX run_history_job ON run_history(job_id);
    """,
    # 10: a token's expiry (NULL: never; users made before expire never), and every admin action
    # (user added/removed, token rotated, another user's job taken down, orphans swept): audit
    """
    ALTER TABLE users ADD COLUMN expires_at {real};
    CREATE TABLE audit (
        id {autoid},
        ts {real} NOT NULL,
        actor TEXT NOT NULL,
        action TEXT NOT NULL,
        target TEXT,
        detail TEXT
    );
    CREATE INDEX audit_ts ON audit(ts);
    """,
    # 11: secrets that belong to a user (owner '*': the lab's, granted by an admin), encrypted
    # (sftctl.vault: AES-GCM, never the value in clear), and where a job's secret values come
    # from: 'store' (submitted through a server: its owner's secrets only), NULL (this machine)
    """
    CREATE TABLE secrets (
        owner TEXT NOT NULL,
        name TEXT NOT NULL,
        ciphertext TEXT NOT NULL,
        created_at {real} NOT NULL,
        updated_at {real} NOT NULL,
        PRIMARY KEY (owner, name)
    );
    ALTER TABLE jobs ADD COLUMN secrets_from TEXT;
    """,
    # 12: each node's GPU samples as the health agent reports them (issue 36's dashboard):
    # min/max per measure (equal for a raw sample), thinned into buckets as they age (GPU_TIERS)
    """
    CREATE TABLE gpu_samples (
        id {autoid},
        job_id TEXT NOT NULL REFERENCES jobs(id) ON DELETE CASCADE,
        node_rank {int} NOT NULL,
        gpu {int} NOT NULL,
        ts {real} NOT NULL,
        span_s {real} NOT NULL DEFAULT 0,
        n {int} NOT NULL DEFAULT 1,
        util_pct_min {real}, util_pct_max {real},
        memory_mib_min {real}, memory_mib_max {real},
        temp_c_min {real}, temp_c_max {real},
        sm_clock_mhz_min {real}, sm_clock_mhz_max {real},
        power_w_min {real}, power_w_max {real},
        xids {int} NOT NULL DEFAULT 0,
        ecc {int}
    );
    CREATE INDEX gpu_samples_job ON gpu_samples(job_id, node_rank, gpu, ts);
    """,
    # 13: the memory of bad machines (issue 41.3): a host, instance or Slurm node a health verdict
    # condemned, per verdict kind, kept out of every job until the mark decays (sftctl.state.machines)
    """
    CREATE TABLE bad_machines (
        provider TEXT NOT NULL,
        machine TEXT NOT NULL,
        kind TEXT NOT NULL,
        zone TEXT NOT NULL DEFAULT '',
        evidence TEXT NOT NULL,
        job_id TEXT,
        count {int} NOT NULL DEFAULT 1,
        first_at {real} NOT NULL,
        at {real} NOT NULL,
        until {real} NOT NULL,
        PRIMARY KEY (provider, machine, kind)
    );
    CREATE INDEX bad_machines_until ON bad_machines(provider, until);
    """,
]
#: the schema this sftctl writes: one version per migration (append a migration, never renumber)
SCHEMA_VERSION = len(MIGRATIONS)

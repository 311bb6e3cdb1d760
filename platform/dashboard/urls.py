from django.contrib.auth import views as auth_views
from django.urls import path

from dashboard import views

urlpatterns = [
    path("login/", auth_views.LoginView.as_view(), name="login"),
    path("logout/", auth_views.LogoutView.as_view(), name="logout"),
    path("", views.runs_page, name="runs-page"),
    path("runs/new", views.run_new_page, name="run-new-page"),
    path("runs/<int:run_id>", views.run_page, name="run-page"),
    path("runs/compare/", views.compare_page, name="compare-page"),
    path("deployments", views.deployments_page, name="deployments-page"),
    path("deployments/<int:deployment_id>", views.deployment_page, name="deployment-page"),
    path("hosts", views.hosts_page, name="hosts-page"),
    path("queue", views.queue_page, name="queue-page"),
    path("settings/webhooks", views.webhooks_page, name="webhooks-page"),
    path("projects", views.projects_page, name="projects-page"),
    path("dashboard/sparklines/", views.sparklines, name="dashboard-sparklines"),
]

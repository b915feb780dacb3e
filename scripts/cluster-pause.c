/* The pause image of the real-cluster tier (scripts/cluster-image.sh): the process that holds a
 * pod's namespaces. It waits for signals, exits on SIGINT/SIGTERM and reaps zombies (it is PID 1
 * of the pod when the pod shares its PID namespace). Built with `gcc -static`. */
#include <signal.h>
#include <stdlib.h>
#include <sys/wait.h>
#include <unistd.h>

static void stop(int sig) { (void)sig; _exit(0); }

static void reap(int sig) {
  (void)sig;
  while (waitpid(-1, NULL, WNOHANG) > 0) {
  }
}

int main(void) {
  struct sigaction exit_action = {.sa_handler = stop};
  struct sigaction reap_action = {.sa_handler = reap, .sa_flags = SA_NOCLDSTOP};
  if (sigaction(SIGINT, &exit_action, NULL) < 0 || sigaction(SIGTERM, &exit_action, NULL) < 0 ||
      sigaction(SIGCHLD, &reap_action, NULL) < 0) {
    return 1;
  }
  for (;;) pause();
}

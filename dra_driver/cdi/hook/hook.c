/*
 * gpu-dra-cdi-hook: the OCI createContainer hook that gpu-dra's CDI specs name.
 *
 * The container runtime runs it after the container's mounts are in place and before
 * pivot_root, in the container's mount namespace, with the OCI state on standard input. It
 * makes the driver libraries that the spec bind-mounted into one directory loadable by any
 * image, whatever that image's loader searches by default:
 *
 *   gpu-dra-cdi-hook create-symlinks --link TARGET::LINK [--link TARGET::LINK ...]
 *       create the symbolic link LINK -> TARGET in the container (libcuda.so.1 ->
 *       libcuda.so.<version>, libcuda.so -> libcuda.so.1); an existing symlink is replaced,
 *       any other existing file is left alone.
 *   gpu-dra-cdi-hook update-ldcache --folder DIR [--folder DIR ...]
 *       list DIR in the container's /etc/ld.so.conf.d/00-gpu-dra.conf and rebuild the
 *       container's loader cache (/etc/ld.so.cache) with the host's ldconfig, run inside the
 *       container's root. Never a program of the image: the hook runs with the runtime's
 *       privileges, before the container's confinement applies.
 *
 * Both forms take the same arguments as NVIDIA's nvidia-cdi-hook, so a spec can name either.
 * Everything is done inside chroot(<container root>): symbolic links in the image resolve
 * inside the image, never on the host. Static binary, no dependencies: it runs on any node.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>

#define MAX_STATE (1 << 20)
#define MAX_CONFIG (64 << 20)
#define CONF_FILE "/etc/ld.so.conf.d/00-gpu-dra.conf"

static void die(const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    fputs("gpu-dra-cdi-hook: ", stderr);
    vfprintf(stderr, fmt, ap);
    fputc('\n', stderr);
    va_end(ap);
    exit(1);
}

static char *read_fd(int fd, size_t limit, const char *what) {
    size_t cap = 4096, len = 0;
    char *buf = malloc(cap + 1);
    if (!buf) die("out of memory");
    for (;;) {
        if (len == cap) {
            if (cap >= limit) die("%s is larger than %zu bytes", what, limit);
            cap *= 2;
            buf = realloc(buf, cap + 1);
            if (!buf) die("out of memory");
        }
        ssize_t n = read(fd, buf + len, cap - len);
        if (n < 0) {
            if (errno == EINTR) continue;
            die("cannot read %s: %s", what, strerror(errno));
        }
        if (n == 0) break;
        len += (size_t)n;
    }
    buf[len] = '\0';
    return buf;
}

static const char *skip_ws(const char *p) {
    while (*p == ' ' || *p == '\t' || *p == '\n' || *p == '\r') p++;
    return p;
}

static void put_utf8(char **out, unsigned cp) {
    char *o = *out;
    if (cp < 0x80) {
        *o++ = (char)cp;
    } else if (cp < 0x800) {
        *o++ = (char)(0xC0 | (cp >> 6));
        *o++ = (char)(0x80 | (cp & 0x3F));
    } else {
        *o++ = (char)(0xE0 | (cp >> 12));
        *o++ = (char)(0x80 | ((cp >> 6) & 0x3F));
        *o++ = (char)(0x80 | (cp & 0x3F));
    }
    *out = o;
}

/* Decode the JSON string starting at p (on its opening quote); NULL if malformed. */
static char *json_string(const char *p) {
    if (*p != '"') return NULL;
    p++;
    char *out = malloc(strlen(p) * 3 + 1), *o = out;
    if (!out) die("out of memory");
    while (*p && *p != '"') {
        if ((unsigned char)*p < 0x20) { free(out); return NULL; }
        if (*p != '\\') { *o++ = *p++; continue; }
        p++;
        switch (*p) {
        case '"': case '\\': case '/': *o++ = *p; break;
        case 'b': *o++ = '\b'; break;
        case 'f': *o++ = '\f'; break;
        case 'n': *o++ = '\n'; break;
        case 'r': *o++ = '\r'; break;
        case 't': *o++ = '\t'; break;
        case 'u': {
            unsigned cp = 0;
            for (int i = 1; i <= 4; i++) {
                char c = p[i];
                cp <<= 4;
                if (c >= '0' && c <= '9') cp |= (unsigned)(c - '0');
                else if (c >= 'a' && c <= 'f') cp |= (unsigned)(c - 'a' + 10);
                else if (c >= 'A' && c <= 'F') cp |= (unsigned)(c - 'A' + 10);
                else { free(out); return NULL; }
            }
            if (cp == 0 || (cp >= 0xD800 && cp <= 0xDFFF)) { free(out); return NULL; }
            put_utf8(&o, cp);
            p += 4;
            break;
        }
        default: free(out); return NULL;
        }
        p++;
    }
    if (*p != '"') { free(out); return NULL; }
    *o = '\0';
    return out;
}

/* The string value of the first `"key": "..."` in text (a raw `"key"` followed by a colon is
 * always a real key: a quote inside a JSON string is escaped). */
static char *string_member(const char *text, const char *key) {
    char pattern[64];
    snprintf(pattern, sizeof pattern, "\"%s\"", key);
    for (const char *p = strstr(text, pattern); p; p = strstr(p + 1, pattern)) {
        const char *q = skip_ws(p + strlen(pattern));
        if (*q != ':') continue;
        q = skip_ws(q + 1);
        if (*q == '"') return json_string(q);
    }
    return NULL;
}

/* The container's root directory as the runtime sees it: root.path of the bundle's config. */
static char *container_root(void) {
    char *state = read_fd(0, MAX_STATE, "the OCI state on standard input");
    char *bundle = string_member(state, "bundle");
    if (!bundle || bundle[0] != '/') die("the OCI state names no absolute bundle path");
    char path[PATH_MAX];
    if (snprintf(path, sizeof path, "%s/config.json", bundle) >= (int)sizeof path)
        die("bundle path too long");
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) die("cannot open %s: %s", path, strerror(errno));
    char *config = read_fd(fd, MAX_CONFIG, path);
    close(fd);
    const char *root = NULL;
    for (const char *p = strstr(config, "\"root\""); p; p = strstr(p + 1, "\"root\"")) {
        const char *q = skip_ws(p + 6);
        if (*q != ':') continue;
        q = skip_ws(q + 1);
        if (*q == '{') { root = q; break; }
    }
    char *rel = root ? string_member(root, "path") : NULL;
    if (!rel || !*rel) die("%s has no root.path", path);
    char joined[PATH_MAX];
    if (rel[0] == '/') snprintf(joined, sizeof joined, "%s", rel);
    else if (snprintf(joined, sizeof joined, "%s/%s", bundle, rel) >= (int)sizeof joined)
        die("root path too long");
    char *real = realpath(joined, NULL);
    if (!real) die("cannot resolve the container root %s: %s", joined, strerror(errno));
    return real;
}

static void mkdirs(const char *dir) {
    char buf[PATH_MAX];
    if (snprintf(buf, sizeof buf, "%s", dir) >= (int)sizeof buf) die("path too long: %s", dir);
    for (char *p = buf + 1; ; p++) {
        if (*p == '/' || *p == '\0') {
            char saved = *p;
            *p = '\0';
            if (mkdir(buf, 0755) < 0 && errno != EEXIST) die("cannot create %s: %s", buf, strerror(errno));
            *p = saved;
            if (saved == '\0') break;
        }
    }
}

static void create_symlink(const char *spec) {
    const char *sep = strstr(spec, "::");
    if (!sep || sep == spec || sep[2] != '/') die("--link %s: want TARGET::/ABSOLUTE/LINK", spec);
    char target[PATH_MAX], link[PATH_MAX];
    snprintf(target, sizeof target, "%.*s", (int)(sep - spec), spec);
    snprintf(link, sizeof link, "%s", sep + 2);
    char parent[PATH_MAX];
    snprintf(parent, sizeof parent, "%s", link);
    char *slash = strrchr(parent, '/');
    if (slash != parent) { *slash = '\0'; mkdirs(parent); }
    struct stat st;
    if (lstat(link, &st) == 0) {
        if (!S_ISLNK(st.st_mode)) return; /* a file the image or a mount put there wins */
        char current[PATH_MAX];
        ssize_t n = readlink(link, current, sizeof current - 1);
        if (n >= 0) {
            current[n] = '\0';
            if (strcmp(current, target) == 0) return;
        }
        if (unlink(link) < 0) die("cannot replace %s: %s", link, strerror(errno));
    }
    if (symlink(target, link) < 0) die("cannot create %s -> %s: %s", link, target, strerror(errno));
}

static void write_conf(char **folders, int n) {
    mkdirs("/etc/ld.so.conf.d");
    struct stat st;
    if (stat("/etc/ld.so.conf", &st) < 0) {
        /* an image without any loader configuration: make the drop-in directory count */
        FILE *f = fopen("/etc/ld.so.conf", "w");
        if (!f) die("cannot create /etc/ld.so.conf: %s", strerror(errno));
        fputs("include /etc/ld.so.conf.d/*.conf\n", f);
        if (fclose(f) != 0) die("cannot write /etc/ld.so.conf: %s", strerror(errno));
    }
    FILE *f = fopen(CONF_FILE, "w");
    if (!f) die("cannot create %s: %s", CONF_FILE, strerror(errno));
    fputs("# Written by gpu-dra-cdi-hook: NVIDIA driver libraries of this container's GPU claim.\n", f);
    for (int i = 0; i < n; i++) fprintf(f, "%s\n", folders[i]);
    if (fclose(f) != 0) die("cannot write %s: %s", CONF_FILE, strerror(errno));
}

/* The host's ldconfig, opened before entering the container: a statically linked ELF file
 * (Debian's, RHEL's and Ubuntu's ldconfig.real are), so it runs inside any container root. */
static int open_host_ldconfig(void) {
    static const char *candidates[] = {"/sbin/ldconfig.real", "/usr/sbin/ldconfig.real",
                                       "/sbin/ldconfig", "/usr/sbin/ldconfig", NULL};
    for (const char **c = candidates; *c; c++) {
        int fd = open(*c, O_RDONLY | O_CLOEXEC);
        if (fd < 0) continue;
        char magic[4];
        if (pread(fd, magic, 4, 0) == 4 && memcmp(magic, "\x7f" "ELF", 4) == 0) return fd;
        close(fd); /* a wrapper script: its interpreter would come from the image */
    }
    return -1;
}

static void run_ldconfig(char **folders, int n, int host_ldconfig) {
    char **argv = calloc((size_t)n + 2, sizeof *argv);
    if (!argv) die("out of memory");
    argv[0] = "ldconfig";
    for (int i = 0; i < n; i++) argv[i + 1] = folders[i];
    char *envp[] = {"PATH=/usr/sbin:/usr/bin:/sbin:/bin", NULL};
    if (host_ldconfig < 0) {
        fputs("gpu-dra-cdi-hook: no ldconfig on the host; the loader cache is not updated\n",
              stderr);
        exit(0);
    }
    fexecve(host_ldconfig, argv, envp);
    die("cannot run the host's ldconfig in the container: %s", strerror(errno));
}

int main(int argc, char **argv) {
    if (argc < 2) die("usage: gpu-dra-cdi-hook create-symlinks|update-ldcache ...");
    const char *cmd = argv[1];
    const char *flag;
    if (strcmp(cmd, "create-symlinks") == 0) flag = "--link";
    else if (strcmp(cmd, "update-ldcache") == 0) flag = "--folder";
    else die("unknown command %s (create-symlinks or update-ldcache)", cmd);
    char **values = calloc((size_t)argc, sizeof *values);
    int n = 0;
    if (!values) die("out of memory");
    for (int i = 2; i < argc; i++) {
        size_t len = strlen(flag);
        if (strcmp(argv[i], flag) == 0 && i + 1 < argc) values[n++] = argv[++i];
        else if (strncmp(argv[i], flag, len) == 0 && argv[i][len] == '=') values[n++] = argv[i] + len + 1;
        else die("%s: unexpected argument %s", cmd, argv[i]);
    }
    for (int i = 0; i < n && flag[2] == 'f'; i++)
        if (values[i][0] != '/') die("--folder %s is not an absolute path", values[i]);
    char *root = container_root();
    int host_ldconfig = -1;
    if (flag[2] == 'f') host_ldconfig = open_host_ldconfig();
    pid_t pid = fork();
    if (pid < 0) die("fork: %s", strerror(errno));
    if (pid == 0) {
        if (chroot(root) < 0 || chdir("/") < 0) die("cannot enter %s: %s", root, strerror(errno));
        umask(022);
        if (flag[2] == 'l') {
            for (int i = 0; i < n; i++) create_symlink(values[i]);
            exit(0);
        }
        write_conf(values, n);
        run_ldconfig(values, n, host_ldconfig);
    }
    int status;
    while (waitpid(pid, &status, 0) < 0)
        if (errno != EINTR) die("waitpid: %s", strerror(errno));
    if (WIFEXITED(status)) return WEXITSTATUS(status);
    die("%s was killed by signal %d", cmd, WTERMSIG(status));
    return 1;
}

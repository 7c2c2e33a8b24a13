#!/usr/bin/env python3
"""moto for the AWS provider's end-to-end tests: serves EC2, ELB, ELBv2 on 127.0.0.1:PORT,
creates the fixture the AWS provider needs for cluster CLUSTER (VPC, subnet tagged for ELBs,
internet gateway, route table with a default route, node security group, instances tagged
for the cluster) and prints it as one JSON line on stdout; then serves until stdin closes,
answering each line read from stdin with one JSON line of moto's state:
  routes             the fixture's route table's routes
  elbs               classic load balancers with their instances
  nlbs               network load balancers with their targets
  groups             the VPC's security groups with their ingress rules
  calls              the AWS calls made by others than this fixture since it started, by
                     "service:Action" (counted at moto's front, before moto answers)
  stop ID / terminate ID   changes an instance's state

moto gap patched here: moto creates classic ELBs without a HealthCheck and leaves it out of
DescribeLoadBalancers, which the AWS provider dereferences; new classic ELBs get AWS's
default TCP check on their first listener's instance port, as AWS gives them.

Usage: moto_fixture.py PORT CLUSTER INSTANCES SUBNET [--bind IP] [--ips IP,IP,...]
The subnet is 10.0.SUBNET.0/24 (tests sharing an API server need instances of distinct private
DNS names). --bind serves on IP instead of 127.0.0.1 (for pods on a bridge); --ips gives the
instances these private IPs instead (one instance each; the VPC is their /16, the subnet their
/24), for instances that stand for real nodes.
"""
import argparse
import io
import json
import sys
import threading
import urllib.parse
from collections import Counter

import boto3
from moto.elb import models as elb_models
from moto.server import ThreadedMotoServer

REGION = "us-east-1"
ZONE = "us-east-1a"


def default_health_check():
    original = elb_models.ELBBackend.create_load_balancer

    def create_load_balancer(self, name, zones, ports, *args, **kwargs):
        lb = original(self, name, zones, ports, *args, **kwargs)
        if lb.health_check is None and lb.listeners:
            port = lb.listeners[0].instance_port
            lb.health_check = elb_models.FakeHealthCheck("5", "2", "6", "30", f"TCP:{port}")
        return lb

    elb_models.ELBBackend.create_load_balancer = create_load_balancer


CALLS = Counter()
CALLS_LOCK = threading.Lock()
# API versions of the query-protocol services that share a signing name.
VERSIONS = {"2012-06-01": "elb", "2015-12-01": "elbv2", "2016-11-15": "ec2"}


def counted(app):
    """The WSGI app, counting every request not made by this fixture's boto3."""
    def call(environ, start_response):
        if "Boto3/" not in environ.get("HTTP_USER_AGENT", ""):
            size = int(environ.get("CONTENT_LENGTH") or 0)
            body = environ["wsgi.input"].read(size) if size else b""
            environ["wsgi.input"] = io.BytesIO(body)
            form = urllib.parse.parse_qs(body.decode("utf-8", "replace"))
            form.update(urllib.parse.parse_qs(environ.get("QUERY_STRING", "")))
            action = form.get("Action", ["?"])[0]
            service = VERSIONS.get(form.get("Version", [""])[0])
            if service is None:
                scope = environ.get("HTTP_AUTHORIZATION", "").split("Credential=")[-1].split("/")
                service = scope[3] if len(scope) > 3 else "?"
            with CALLS_LOCK:
                CALLS[f"{service}:{action}"] += 1
        return app(environ, start_response)
    return call


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("port", type=int)
    parser.add_argument("cluster")
    parser.add_argument("count", type=int)
    parser.add_argument("octet", type=int)
    parser.add_argument("--bind", default="127.0.0.1")
    parser.add_argument("--ips", default="")
    args = parser.parse_args()
    port, cluster, count = args.port, args.cluster, args.count
    ips = [ip for ip in args.ips.split(",") if ip]
    if ips:
        a, b, c, _ = ips[0].split(".")
        vpc_cidr, subnet_cidr = f"{a}.{b}.0.0/16", f"{a}.{b}.{c}.0/24"
    else:
        vpc_cidr, subnet_cidr = "10.0.0.0/16", f"10.0.{args.octet}.0/24"
    default_health_check()
    server = ThreadedMotoServer(ip_address=args.bind, port=port, verbose=False)
    server.start()
    server._server.app = counted(server._server.app)
    endpoint = f"http://{args.bind}:{port}"
    ec2 = boto3.client("ec2", region_name=REGION, endpoint_url=endpoint,
                       aws_access_key_id="testing", aws_secret_access_key="testing")
    owned = [{"Key": f"kubernetes.io/cluster/{cluster}", "Value": "owned"}]

    def tags(kind, extra=()):
        return [{"ResourceType": kind, "Tags": owned + list(extra)}]

    vpc = ec2.create_vpc(CidrBlock=vpc_cidr, TagSpecifications=tags("vpc"))["Vpc"]["VpcId"]
    subnet = ec2.create_subnet(VpcId=vpc, CidrBlock=subnet_cidr, AvailabilityZone=ZONE,
                               TagSpecifications=tags("subnet", [{"Key": "kubernetes.io/role/elb", "Value": "1"}]))["Subnet"]["SubnetId"]
    igw = ec2.create_internet_gateway(TagSpecifications=tags("internet-gateway"))["InternetGateway"]["InternetGatewayId"]
    ec2.attach_internet_gateway(InternetGatewayId=igw, VpcId=vpc)
    table = ec2.create_route_table(VpcId=vpc, TagSpecifications=tags("route-table"))["RouteTable"]["RouteTableId"]
    ec2.create_route(RouteTableId=table, DestinationCidrBlock="0.0.0.0/0", GatewayId=igw)
    ec2.associate_route_table(RouteTableId=table, SubnetId=subnet)
    group = ec2.create_security_group(GroupName=f"{cluster}-nodes", Description="nodes", VpcId=vpc,
                                      TagSpecifications=tags("security-group"))["GroupId"]
    image = ec2.describe_images()["Images"][0]["ImageId"]
    launch = dict(ImageId=image, InstanceType="m5.large", SubnetId=subnet, SecurityGroupIds=[group],
                  TagSpecifications=tags("instance"))
    if ips:
        launched = [ec2.run_instances(MinCount=1, MaxCount=1, PrivateIpAddress=ip, **launch)["Instances"][0] for ip in ips]
    else:
        launched = ec2.run_instances(MinCount=count, MaxCount=count, **launch)["Instances"]
    instances = [{"id": i["InstanceId"], "private_dns": i["PrivateDnsName"], "private_ip": i["PrivateIpAddress"]}
                 for i in launched]
    print("ccm-fixture " + json.dumps({"endpoint": endpoint, "region": REGION, "zone": ZONE, "vpc": vpc, "subnet": subnet,
                      "route_table": table, "security_group": group, "instances": instances}), flush=True)
    elb = boto3.client("elb", region_name=REGION, endpoint_url=endpoint,
                       aws_access_key_id="testing", aws_secret_access_key="testing")
    elbv2 = boto3.client("elbv2", region_name=REGION, endpoint_url=endpoint,
                         aws_access_key_id="testing", aws_secret_access_key="testing")
    for line in sys.stdin:
        words = line.split()
        if not words:
            continue
        try:
            if words[0] == "routes":
                rt = ec2.describe_route_tables(RouteTableIds=[table])["RouteTables"][0]
                answer = [{"destination": r.get("DestinationCidrBlock", ""), "instance": r.get("InstanceId", "")}
                          for r in rt["Routes"]]
            elif words[0] == "elbs":
                answer = [{"name": lb["LoadBalancerName"], "dns": lb["DNSName"], "scheme": lb.get("Scheme", ""),
                           "instances": sorted(i["InstanceId"] for i in lb.get("Instances", [])),
                           "ports": sorted(l["Listener"]["LoadBalancerPort"] for l in lb.get("ListenerDescriptions", []))}
                          for lb in elb.describe_load_balancers()["LoadBalancerDescriptions"]]
            elif words[0] == "nlbs":
                answer = []
                for lb in elbv2.describe_load_balancers()["LoadBalancers"]:
                    targets = []
                    try:
                        groups = elbv2.describe_target_groups(LoadBalancerArn=lb["LoadBalancerArn"])["TargetGroups"]
                        for group in groups:
                            health = elbv2.describe_target_health(TargetGroupArn=group["TargetGroupArn"])
                            targets += [t["Target"]["Id"] for t in health["TargetHealthDescriptions"]]
                    except elbv2.exceptions.LoadBalancerNotFoundException:
                        continue  # deleted between the two calls
                    except elbv2.exceptions.TargetGroupNotFoundException:
                        continue
                    answer.append({"name": lb["LoadBalancerName"], "dns": lb["DNSName"], "type": lb["Type"],
                                   "targets": sorted(targets)})
            elif words[0] == "groups":
                answer = []
                for g in ec2.describe_security_groups(Filters=[{"Name": "vpc-id", "Values": [vpc]}])["SecurityGroups"]:
                    rules = []
                    for p in g.get("IpPermissions", []):
                        sources = [r["CidrIp"] for r in p.get("IpRanges", [])]
                        sources += [r["GroupId"] for r in p.get("UserIdGroupPairs", [])]
                        rules.append({"protocol": p.get("IpProtocol", ""), "from": p.get("FromPort", -1),
                                      "to": p.get("ToPort", -1), "sources": sorted(sources)})
                    answer.append({"id": g["GroupId"], "name": g["GroupName"], "ingress": rules})
            elif words[0] == "calls":
                with CALLS_LOCK:
                    answer = dict(CALLS)
            elif words[0] == "stop":
                ec2.stop_instances(InstanceIds=[words[1]])
                answer = "ok"
            elif words[0] == "terminate":
                ec2.terminate_instances(InstanceIds=[words[1]])
                answer = "ok"
            else:
                answer = {"error": f"unknown command {words[0]!r}"}
        except Exception as e:  # the test reads the error and fails with it
            answer = {"error": repr(e)}
        print("ccm-fixture " + json.dumps(answer), flush=True)
    server.stop()


if __name__ == "__main__":
    main()
